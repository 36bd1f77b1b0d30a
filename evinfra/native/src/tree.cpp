// The cluster-wide prefix tree of KV blocks (paper 4.3, Appendix A.3): which node holds which
// block in which tier, and the longest prefix of a path each node holds.
//
// A block's hash names the block *and* its whole prefix, so no child pointers are needed: a
// block has a slot, and a slot has two holder bitmaps (L1: GPU, L2: host), one bit per node,
// W words of 64 nodes each. A slot is one record (its hash, a stamp, then each word's L1 and
// L2 bits side by side), so a store, a removal or a prefix walk touches one cache line per
// block. Slots are handed out lowest-freed first, as the Python tree did: the order clear()
// reports a node's lost blocks in (slot order) is part of the simulator's output.
//
// A batch given the directory's branch table hands it the blocks the node lost (E.2 line 20)
// in the same call, so they never become Python objects: the directory's KV path is one call.
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>

#include "common.h"

namespace evinfra {
namespace {

constexpr int kL2 = 1, kL1 = 2;

using HashArray = nb::ndarray<const Hash, nb::ndim<1>, nb::c_contig, nb::device::cpu>;  // tier bits of store(); remove() takes one tier

// Counters of applied and tolerated events (the Python shell's TreeStats, without the
// unknown nodes it counts itself).
struct Counts {
  uint64_t blocks_stored = 0, blocks_removed = 0, clears = 0, unknown_parent = 0,
           unknown_removal = 0, duplicate_hash = 0, untracked_medium = 0,
           block_size_mismatch = 0;
};

// The Python classes of SGLang's KV events (core/events.py), read by attribute.
struct EventTypes {
  nb::object stored, removed, cleared;
};

class Tree {
 public:
  Tree(size_t page_size, EventTypes types) : page_size_(page_size), types_(std::move(types)) {
    grow_words(1);
  }

  int add_node() {
    if (nodes_ == 64 * words_) grow_words(words_ + 1);
    held_l1_.push_back(0);
    held_l2_.push_back(0);
    held_any_.push_back(0);
    return nodes_++;
  }

  size_t size() const { return slot_.size(); }
  bool contains(Hash h) const { return slot_.find(h) != slot_.end(); }

  // A node's batch of KV events, applied in order. Returns the blocks the node no longer
  // holds in any tier once the whole batch is applied (lost, in order: E.2 line 20 zeroes
  // their counts; a block the batch drops and stores again, as an engine's resync clears and
  // republishes its cache, is not lost and keeps its count) and the tolerated
  // problems whose count reached a power of two, as (what, occurrences, fields) for the log,
  // or None when there are none: bad events never raise, they are counted and the tree
  // stays consistent. Given the
  // directory's branch table (`counts`, not None), the lost blocks go to its evicted() at the
  // end of the batch instead, and the list returned is empty.
  nb::tuple apply_batch(int node, nb::handle events, nb::handle counts) {
    check_node(node);
    BranchTable* table = counts.is_none() ? nullptr : &branch_table(counts);
    lost_.clear();
    // Only a store after a loss can give a lost block back (a resync): without one the lost
    // list stands as built, with no probe per block on the eviction path.
    bool stored_after_loss = false;
    nb::object problems = nb::none();  // a list once there is one to report
    auto tolerate = [&](uint64_t Counts::*what, const char* name, auto&& fields) {
      const uint64_t n = ++(counts_.*what);
      if ((n & (n - 1)) != 0) return;
      if (problems.is_none()) problems = nb::list();
      nb::borrow<nb::list>(problems).append(nb::make_tuple(name, n, fields()));
    };
    nb::object batch = nb::steal(PySequence_Fast(events.ptr(), "events must be a sequence"));
    if (!batch.is_valid()) throw nb::python_error();
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(batch.ptr()); ++i) {
      nb::handle e = PySequence_Fast_GET_ITEM(batch.ptr(), i);
      nb::handle type = e.type();
      if (type.is(types_.cleared)) {
        clear(node, lost_);
        ++counts_.clears;
        continue;
      }
      const bool stored = type.is(types_.stored);
      if (!stored && !type.is(types_.removed)) {
        throw nb::type_error("not a KV event");
      }
      nb::object medium = nb::steal(PyObject_GetAttr(e.ptr(), names_.medium.ptr()));
      if (!medium.is_valid()) throw nb::python_error();
      const int tier = tier_of(medium);
      if (!tier) {
        tolerate(&Counts::untracked_medium, "untracked_medium",
                 [&] { return fields("medium", medium); });
        continue;
      }
      read_hashes(attr(e, names_.block_hashes), hashes_);
      if (stored) {
        stored_after_loss |= !lost_.empty();
        nb::object size = attr(e, names_.block_size), parent = attr(e, names_.parent);
        if (nb::cast<size_t>(size) != page_size_) {
          tolerate(&Counts::block_size_mismatch, "block_size_mismatch", [&] {
            nb::dict f = fields("block_size", size);
            f["page_size"] = page_size_;
            return f;
          });
        }
        std::optional<Hash> p;
        if (!parent.is_none()) p = nb::cast<Hash>(parent);
        const auto [orphan, duplicate] = store(node, hashes_, p, tier);
        if (orphan) {
          tolerate(&Counts::unknown_parent, "unknown_parent",
                   [&] { return fields("parent", parent); });
        }
        if (duplicate) tolerate(&Counts::duplicate_hash, "duplicate_hash", [] { return nb::dict(); });
        counts_.blocks_stored += hashes_.size();
      } else {
        unknown_.clear();
        remove(node, hashes_, tier == kL1, lost_, unknown_);
        for (Hash h : unknown_) {
          tolerate(&Counts::unknown_removal, "unknown_removal",
                   [&] { return fields("block", nb::int_(h)); });
        }
        counts_.blocks_removed += hashes_.size() - unknown_.size();
      }
    }
    if (stored_after_loss) {
      lost_.erase(std::remove_if(lost_.begin(), lost_.end(), [&](Hash h) {
                    const auto [l1, l2] = tiers(h, node);
                    return l1 || l2;
                  }),
                  lost_.end());
    }
    if (table != nullptr) {
      if (!lost_.empty()) evicted(*table, node, lost_);
      return nb::make_tuple(nb::list(), problems);
    }
    return nb::make_tuple(nb::cast(lost_), problems);
  }

  nb::dict counts() const {
    nb::dict d;
    d["blocks_stored"] = counts_.blocks_stored;
    d["blocks_removed"] = counts_.blocks_removed;
    d["clears"] = counts_.clears;
    d["unknown_parent"] = counts_.unknown_parent;
    d["unknown_removal"] = counts_.unknown_removal;
    d["duplicate_hash"] = counts_.duplicate_hash;
    d["untracked_medium"] = counts_.untracked_medium;
    d["block_size_mismatch"] = counts_.block_size_mismatch;
    return d;
  }

  // Returns whether the parent is unknown (checked before the store) and whether a hash
  // repeats within the event.
  std::pair<bool, bool> store(int node, const Hashes& hashes, std::optional<Hash> parent,
                              int tiers) {
    const bool orphan = parent && !contains(*parent);
    bool duplicate = false;
    ++stores_;
    const size_t at = bits_at(node);
    const uint64_t bit = bit_of(node);
    size_t new_l1 = 0, new_l2 = 0, new_any = 0;
    for (Hash h : hashes) {
      auto [it, fresh] = slot_.try_emplace(h, 0);
      if (fresh) {
        it.value() = allocate();
        record(it->second)[kHash] = static_cast<uint64_t>(h);
      }
      uint64_t* r = record(it->second);
      duplicate |= r[kStamp] == stores_;  // a chained hash cannot repeat within one path
      r[kStamp] = stores_;
      uint64_t& l1 = r[at];
      uint64_t& l2 = r[at + 1];
      new_any += !((l1 | l2) & bit);
      if ((tiers & kL1) && !(l1 & bit)) {
        l1 |= bit;
        ++new_l1;
      }
      if ((tiers & kL2) && !(l2 & bit)) {
        l2 |= bit;
        ++new_l2;
      }
    }
    held_l1_[node] += new_l1;
    held_l2_[node] += new_l2;
    held_any_[node] += new_any;
    return {orphan, duplicate};
  }

  // BlockRemoved in one tier. Appends to `lost` the blocks the node no longer holds in any
  // tier (E.2 line 20) and to `unknown` those it did not hold in that tier (tolerated, counted
  // by the caller).
  void remove(int node, const Hashes& hashes, bool l1_tier, Hashes& lost, Hashes& unknown) {
    const size_t mine_at = bits_at(node) + (l1_tier ? 0 : 1);
    const size_t other_at = bits_at(node) + (l1_tier ? 1 : 0);
    const uint64_t bit = bit_of(node);
    size_t gone = 0;
    // Written in place (sized for every block, trimmed after): the loop stays branch-light.
    const size_t lost_from = lost.size();
    lost.resize(lost_from + hashes.size());
    freed_.resize(hashes.size());
    Hash* lost_at = lost.data() + lost_from;
    uint32_t* freed_at = freed_.data();
    for (Hash h : hashes) {
      auto it = slot_.find(h);
      uint64_t* r = record(it == slot_.end() ? 0 : it->second);
      if (!(r[mine_at] & bit)) {
        unknown.push_back(h);
        continue;
      }
      r[mine_at] &= ~bit;
      ++gone;
      if (r[other_at] & bit) continue;
      *lost_at++ = h;
      if (!r[mine_at] && !r[other_at] && unused(r)) {
        *freed_at++ = it->second;
        slot_.erase(it);
        r[kHash] = 0;
      }
    }
    const size_t gone_any = static_cast<size_t>(lost_at - (lost.data() + lost_from));
    lost.resize(lost_from + gone_any);
    freed_.resize(static_cast<size_t>(freed_at - freed_.data()));
    (l1_tier ? held_l1_ : held_l2_)[node] -= gone;
    held_any_[node] -= gone_any;
    release(freed_);
  }

  // The node dropped everything (AllBlocksCleared, a crash, a relaunch): appends its blocks to
  // `lost`, in slot order.
  void clear(int node, Hashes& lost) {
    const size_t at = bits_at(node);
    const uint64_t bit = bit_of(node);
    freed_.clear();
    for (uint32_t s = 1; s < slots() && held_any_[node]; ++s) {
      uint64_t* r = record(s);
      uint64_t& l1 = r[at];
      uint64_t& l2 = r[at + 1];
      if (!((l1 | l2) & bit)) continue;
      held_l1_[node] -= (l1 & bit) != 0;
      held_l2_[node] -= (l2 & bit) != 0;
      --held_any_[node];
      l1 &= ~bit;
      l2 &= ~bit;
      lost.push_back(static_cast<Hash>(r[kHash]));
      if (unused(r)) {
        slot_.erase(static_cast<Hash>(r[kHash]));
        r[kHash] = 0;
        freed_.push_back(s);
      }
    }
    release(freed_);
  }

  // The longest prefix of ``path`` each node holds, in any tier and in L1, and the leading
  // blocks some node holds (union): E.3 line 6's t_c,n and x_n. One probe per block; each
  // node's prefix ends where its bit leaves the running AND of the blocks' bitmaps.
  nb::tuple match(const Hashes& path) const { return match_at(path.data(), path.size()); }

  nb::tuple match_array(HashArray path) const { return match_at(path.data(), path.shape(0)); }

  nb::tuple match_at(const Hash* path, size_t length) const {
    return words_ == 1 ? walk<true>(path, length) : walk<false>(path, length);
  }

  // Which tiers of ``node`` hold ``block``: (L1, L2).
  std::pair<bool, bool> tiers(Hash h, int node) const {
    check_node(node);
    const uint64_t* r = record(lookup(h));
    const uint64_t bit = bit_of(node);
    return {(r[bits_at(node)] & bit) != 0, (r[bits_at(node) + 1] & bit) != 0};
  }

  std::vector<int> holders(Hash h) const {
    const uint64_t* r = record(lookup(h));
    std::vector<int> out;
    for (int n = 0; n < nodes_; ++n) {
      if ((r[bits_at(n)] | r[bits_at(n) + 1]) & bit_of(n)) out.push_back(n);
    }
    return out;
  }

  Hashes blocks_on(int node) const {
    check_node(node);
    Hashes out;
    for (uint32_t s = 1; s < slots(); ++s) {
      const uint64_t* r = record(s);
      if ((r[bits_at(node)] | r[bits_at(node) + 1]) & bit_of(node)) {
        out.push_back(static_cast<Hash>(r[kHash]));
      }
    }
    return out;
  }

  // Blocks ``node`` holds in L2 (tier 0), L1 (1) or either (2).
  size_t held(int node, int tier) const {
    check_node(node);
    return (tier == 0 ? held_l2_ : tier == 1 ? held_l1_ : held_any_)[node];
  }

  size_t entries() const {
    size_t total = 0;
    for (size_t n : held_any_) total += n;
    return total;
  }

  // Bytes of the tables (slot records, the hash map's buckets, free list), for the bench.
  size_t memory() const {
    return records_.capacity() * 8 + free_.capacity() * 4 +
           slot_.bucket_count() * (sizeof(std::pair<Hash, uint32_t>) + 8);
  }

  // Throws std::logic_error where the map, the slots, the bitmaps and the counters disagree.
  void check() const {
    auto fail = [](const std::string& what) { throw std::logic_error(what); };
    if (record(0)[kHash] != 0 || !unused(record(0))) fail("slot 0 is reserved");
    std::vector<char> is_free(slots(), 0);
    for (uint32_t s : free_) {
      if (s == 0 || s >= slots() || is_free[s]) fail("free list corrupt");
      is_free[s] = 1;
      if (record(s)[kHash] != 0 || !unused(record(s))) {
        fail("free slot " + std::to_string(s) + " in use");
      }
    }
    if (slot_.size() + free_.size() != slots() - 1) fail("a slot leaked");
    for (const auto& [h, s] : slot_) {
      if (s == 0 || s >= slots() || is_free[s] || static_cast<Hash>(record(s)[kHash]) != h) {
        fail("map and slots differ");
      }
      if (unused(record(s))) fail("a block held by no node");
    }
    for (int n = 0; n < nodes_; ++n) {
      size_t a = 0, b = 0, c = 0;
      for (uint32_t s = 1; s < slots(); ++s) {
        const uint64_t x = (record(s)[bits_at(n)] & bit_of(n)) != 0;
        const uint64_t y = (record(s)[bits_at(n) + 1] & bit_of(n)) != 0;
        a += x;
        b += y;
        c += x | y;
      }
      if (a != held_l1_[n] || b != held_l2_[n] || c != held_any_[n]) fail("held counters");
    }
  }

 private:
  // SGLang's medium of a KV event (Tier.from_medium): no medium is the GPU radix cache
  // (events published without HiCache); DISK and external tiers are not tracked (0).
  static int tier_of(nb::handle medium) {
    if (medium.is_none()) return kL1;
    if (!nb::isinstance<nb::str>(medium)) return 0;
    const char* m = nb::borrow<nb::str>(medium).c_str();
    if (std::strcmp(m, "GPU") == 0) return kL1;
    if (std::strcmp(m, "CPU_PINNED") == 0) return kL2;
    return 0;
  }

  static nb::dict fields(const char* key, nb::handle value) {
    nb::dict d;
    d[key] = value;
    return d;
  }

  void check_node(int node) const {
    if (node < 0 || node >= nodes_) throw nb::index_error("no such node index");
  }

  size_t lookup(Hash h) const {
    auto it = slot_.find(h);
    return it == slot_.end() ? 0 : it->second;
  }

  // A slot's record: its hash, its stamp, then word w's L1 bits at kBits + 2w and its L2 bits
  // right after them.
  static constexpr size_t kHash = 0, kStamp = 1, kBits = 2;
  size_t stride() const { return stride_; }
  size_t slots() const { return slots_; }
  uint64_t* record(size_t s) { return records_.data() + s * stride(); }
  const uint64_t* record(size_t s) const { return records_.data() + s * stride(); }
  // Where a node's L1 word sits in a record (its L2 word follows), and its bit there.
  static size_t bits_at(int node) { return kBits + 2 * static_cast<size_t>(node / 64); }
  static uint64_t bit_of(int node) { return uint64_t{1} << (node % 64); }

  bool unused(const uint64_t* r) const {
    for (size_t i = kBits; i < stride(); ++i) {
      if (r[i]) return false;
    }
    return true;
  }

  uint32_t allocate() {
    if (!free_.empty()) {
      const uint32_t s = free_.back();
      free_.pop_back();
      return s;
    }
    // Grown by doubling here, not by the vector's own push: one fill per doubling.
    if ((slots_ + 1) * stride_ > records_.size()) {
      records_.resize(std::max(2 * records_.size(), (slots_ + 1) * stride_), 0);
    }
    return static_cast<uint32_t>(slots_++);
  }

  // Freed slots are handed out lowest first: a run freed together and stored again gets
  // consecutive slots again.
  void release(std::vector<uint32_t>& freed) {
    // Usually ascending already (a run of a path, stored in order).
    if (std::is_sorted(freed.begin(), freed.end())) {
      std::reverse(freed.begin(), freed.end());
    } else {
      std::sort(freed.begin(), freed.end(), std::greater<>());
    }
    free_.insert(free_.end(), freed.begin(), freed.end());
  }

  void grow_words(int words) {
    const size_t old = stride_, n = words_ ? slots_ : 1;
    slots_ = n;
    words_ = words;
    stride_ = kBits + 2 * static_cast<size_t>(words);
    BigVector<uint64_t> records(n * stride(), 0);
    for (size_t s = 0; s < n && old > kBits; ++s) {
      std::copy_n(records_.data() + s * old, old, records.data() + s * stride());
    }
    records_.swap(records);
  }

  // The walk of match(): kOne for one word of nodes (up to 64), which the compiler unrolls.
  template <bool kOne>
  nb::tuple walk(const Hash* path, size_t length) const {
    const int words = kOne ? 1 : words_;
    std::vector<int64_t> own(nodes_, 0), own_l1(nodes_, 0);
    std::vector<uint64_t> any(words), l1(words);
    for (int w = 0; w < words; ++w) {
      const int in_word = std::min(64, nodes_ - 64 * w);
      any[w] = l1[w] = in_word == 64 ? ~uint64_t{0} : (uint64_t{1} << in_word) - 1;
    }
    size_t i = 0;
    for (; i < length; ++i) {
      auto it = slot_.find(path[i]);
      if (it == slot_.end()) break;
      const uint64_t* r = record(it->second) + kBits;
      for (int w = 0; w < words; ++w) {
        const uint64_t tier1 = r[2 * w], either = tier1 | r[2 * w + 1];
        // Most blocks end no node's prefix: the settling is off the common path.
        if (__builtin_expect((any[w] & ~either) | (l1[w] & ~tier1), 0)) {
          settle(any[w] & ~either, w, i, own);
          settle(l1[w] & ~tier1, w, i, own_l1);
          any[w] &= either;
          l1[w] &= tier1;
        }
      }
    }
    for (int w = 0; w < words; ++w) {
      settle(any[w], w, i, own);
      settle(l1[w], w, i, own_l1);
    }
    return nb::make_tuple(i, nb::cast(own), nb::cast(own_l1));
  }

  // Nodes of word ``w`` whose bits are in ``dead`` hold ``at`` leading blocks.
  static void settle(uint64_t dead, int w, size_t at, std::vector<int64_t>& out) {
    while (dead) {
      out[64 * w + __builtin_ctzll(dead)] = static_cast<int64_t>(at);
      dead &= dead - 1;
    }
  }

  // An attribute of a KV event (by its interned name).
  static nb::object attr(nb::handle e, const nb::str& name) {
    nb::object v = nb::steal(PyObject_GetAttr(e.ptr(), name.ptr()));
    if (!v.is_valid()) throw nb::python_error();
    return v;
  }

  // The ints of a sequence of block hashes (signed 64-bit, as the events carry them).
  static void read_hashes(nb::handle seq, Hashes& out) {
    nb::object fast = nb::steal(PySequence_Fast(seq.ptr(), "block_hashes must be a sequence"));
    if (!fast.is_valid()) throw nb::python_error();
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast.ptr());
    out.resize(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!exact_hash(PySequence_Fast_ITEMS(fast.ptr())[i], out[i])) {
        // Not a plain int: its __index__ is Python code, which could change the list.
        nb::object item = nb::borrow(PySequence_Fast_ITEMS(fast.ptr())[i]);
        out[i] = any_hash(item);
        if (PySequence_Fast_GET_SIZE(fast.ptr()) != n) {
          throw nb::value_error("block_hashes changed while read");
        }
      }
    }
  }

  size_t page_size_;
  EventTypes types_;
  struct {
    nb::str medium{"medium"}, block_hashes{"block_hashes"}, block_size{"block_size"},
        parent{"parent_block_hash"};
  } names_;
  Counts counts_;
  int nodes_ = 0, words_ = 0;
  size_t stride_ = kBits;  // words in a slot's record
  HashMap<uint32_t> slot_;
  // The slots' records, stride() words each; slot 0 is never a block's (a missing block
  // reads as it: no holders).
  BigVector<uint64_t> records_;
  size_t slots_ = 0;  // in use or free, slot 0 included (records_ may hold more, zeroed)
  std::vector<uint32_t> free_;
  std::vector<size_t> held_l1_, held_l2_, held_any_;
  // Per slot (kStamp), the store() call that last touched it: finds a hash repeated within
  // one event.
  uint64_t stores_ = 0;
  // Scratch of apply_batch, kept to spare an allocation per call.
  Hashes hashes_, lost_, unknown_;
  std::vector<uint32_t> freed_;
};

}  // namespace

void bind_tree(nb::module_& m) {
  nb::class_<Tree>(m, "Tree", "Blocks by hash, with holder bitmaps per (node, tier).")
      .def("__init__",
           [](Tree* t, size_t page_size, nb::object stored, nb::object removed,
              nb::object cleared) {
             new (t) Tree(page_size, EventTypes{stored, removed, cleared});
           },
           nb::arg("page_size"), nb::arg("stored"), nb::arg("removed"), nb::arg("cleared"))
      .def("apply_batch", &Tree::apply_batch, nb::arg("node"), nb::arg("events"),
           nb::arg("counts").none() = nb::none())
      .def("counts", &Tree::counts)
      .def("add_node", &Tree::add_node)
      .def("__len__", &Tree::size)
      .def("__contains__", &Tree::contains)
      .def("match", &Tree::match_array)
      .def("match", &Tree::match)
      .def("tiers", &Tree::tiers)
      .def("holders", &Tree::holders)
      .def("blocks_on", &Tree::blocks_on)
      .def("held", &Tree::held)
      .def("entries", &Tree::entries)
      .def("memory", &Tree::memory)
      .def("check", &Tree::check);
}

}  // namespace evinfra
