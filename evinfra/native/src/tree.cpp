// The cluster-wide prefix tree of KV blocks (paper 4.3, Appendix A.3): which node holds which
// block in which tier, and the longest prefix of a path each node holds.
//
// A block's hash names the block *and* its whole prefix, so no child pointers are needed: a
// block has a slot, and a slot has two holder bitmaps (L1: GPU, L2: host), one bit per node,
// W words of 64 nodes each, stored slot-major so a prefix walk reads one cache line per block.
// Slots are handed out lowest-freed first, as the Python tree did: the order clear() reports
// a node's lost blocks in (slot order) is part of the simulator's output.
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
    // Slot 0 is never a block's: a missing block reads as it (no holders).
    hash_.push_back(0);
    stamp_.push_back(0);
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
  // holds in any tier (lost, in order: E.2 line 20 zeroes their counts) and the tolerated
  // problems whose count reached a power of two, as (what, occurrences, fields) for the log:
  // bad events never raise, they are counted and the tree stays consistent.
  nb::tuple apply_batch(int node, nb::handle events) {
    check_node(node);
    Hashes lost;
    nb::list problems;
    auto tolerate = [&](uint64_t Counts::*what, const char* name, nb::dict fields) {
      const uint64_t n = ++(counts_.*what);
      if ((n & (n - 1)) == 0) problems.append(nb::make_tuple(name, n, fields));
    };
    for (nb::handle e : events) {
      nb::handle type = e.type();
      if (type.is(types_.cleared)) {
        Hashes gone = clear(node);
        lost.insert(lost.end(), gone.begin(), gone.end());
        ++counts_.clears;
        continue;
      }
      const bool stored = type.is(types_.stored);
      if (!stored && !type.is(types_.removed)) {
        throw nb::type_error("not a KV event");
      }
      nb::object medium = e.attr("medium");
      const int tier = tier_of(medium);
      if (!tier) {
        tolerate(&Counts::untracked_medium, "untracked_medium", fields("medium", medium));
        continue;
      }
      const Hashes hashes = nb::cast<Hashes>(e.attr("block_hashes"));
      if (stored) {
        nb::object size = e.attr("block_size"), parent = e.attr("parent_block_hash");
        if (nb::cast<size_t>(size) != page_size_) {
          nb::dict f = fields("block_size", size);
          f["page_size"] = page_size_;
          tolerate(&Counts::block_size_mismatch, "block_size_mismatch", f);
        }
        std::optional<Hash> p;
        if (!parent.is_none()) p = nb::cast<Hash>(parent);
        const auto [orphan, duplicate] = store(node, hashes, p, tier);
        if (orphan) tolerate(&Counts::unknown_parent, "unknown_parent", fields("parent", parent));
        if (duplicate) tolerate(&Counts::duplicate_hash, "duplicate_hash", nb::dict());
        counts_.blocks_stored += hashes.size();
      } else {
        auto [gone, unknown] = remove(node, hashes, tier == kL1);
        lost.insert(lost.end(), gone.begin(), gone.end());
        for (Hash h : unknown) {
          tolerate(&Counts::unknown_removal, "unknown_removal", fields("block", nb::int_(h)));
        }
        counts_.blocks_removed += hashes.size() - unknown.size();
      }
    }
    return nb::make_tuple(nb::cast(lost), problems);
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
    check_node(node);
    const bool orphan = parent && !contains(*parent);
    bool duplicate = false;
    ++stores_;
    const size_t w = node / 64;
    const uint64_t bit = uint64_t{1} << (node % 64);
    for (Hash h : hashes) {
      uint32_t s;
      auto it = slot_.find(h);
      if (it != slot_.end()) {
        s = it->second;
      } else {
        s = allocate();
        hash_[s] = h;
        slot_.emplace(h, s);
      }
      duplicate |= stamp_[s] == stores_;  // a chained hash cannot repeat within one path
      stamp_[s] = stores_;
      uint64_t& l1 = l1_[s * words_ + w];
      uint64_t& l2 = l2_[s * words_ + w];
      const bool was = (l1 | l2) & bit;
      if ((tiers & kL1) && !(l1 & bit)) {
        l1 |= bit;
        ++held_l1_[node];
      }
      if ((tiers & kL2) && !(l2 & bit)) {
        l2 |= bit;
        ++held_l2_[node];
      }
      if (!was) ++held_any_[node];
    }
    return {orphan, duplicate};
  }

  // BlockRemoved in one tier. Returns the blocks the node no longer holds in any tier (lost,
  // E.2 line 20) and those it did not hold in that tier (tolerated, counted by the caller).
  std::pair<Hashes, Hashes> remove(int node, const Hashes& hashes, bool l1_tier) {
    check_node(node);
    const size_t w = node / 64;
    const uint64_t bit = uint64_t{1} << (node % 64);
    Hashes lost, unknown;
    std::vector<uint32_t> freed;
    for (Hash h : hashes) {
      auto it = slot_.find(h);
      const uint32_t s = it == slot_.end() ? 0 : it->second;
      uint64_t& mine = (l1_tier ? l1_ : l2_)[s * words_ + w];
      const uint64_t other = (l1_tier ? l2_ : l1_)[s * words_ + w];
      if (!(mine & bit)) {
        unknown.push_back(h);
        continue;
      }
      mine &= ~bit;
      --(l1_tier ? held_l1_ : held_l2_)[node];
      if (other & bit) continue;
      --held_any_[node];
      lost.push_back(h);
      if (unused(s)) {
        slot_.erase(it);
        hash_[s] = 0;
        freed.push_back(s);
      }
    }
    release(freed);
    return {std::move(lost), std::move(unknown)};
  }

  // The node dropped everything (AllBlocksCleared, a crash, a relaunch): its blocks, in slot
  // order.
  Hashes clear(int node) {
    check_node(node);
    const size_t w = node / 64;
    const uint64_t bit = uint64_t{1} << (node % 64);
    Hashes lost;
    std::vector<uint32_t> freed;
    for (uint32_t s = 1; s < hash_.size() && held_any_[node]; ++s) {
      uint64_t& l1 = l1_[s * words_ + w];
      uint64_t& l2 = l2_[s * words_ + w];
      if (!((l1 | l2) & bit)) continue;
      held_l1_[node] -= (l1 & bit) != 0;
      held_l2_[node] -= (l2 & bit) != 0;
      --held_any_[node];
      l1 &= ~bit;
      l2 &= ~bit;
      lost.push_back(hash_[s]);
      if (unused(s)) {
        slot_.erase(hash_[s]);
        hash_[s] = 0;
        freed.push_back(s);
      }
    }
    release(freed);
    return lost;
  }

  // The longest prefix of ``path`` each node holds, in any tier and in L1, and the leading
  // blocks some node holds (union): E.3 line 6's t_c,n and x_n. One probe per block; each
  // node's prefix ends where its bit leaves the running AND of the blocks' bitmaps.
  nb::tuple match(const Hashes& path) const { return match_at(path.data(), path.size()); }

  nb::tuple match_array(HashArray path) const { return match_at(path.data(), path.shape(0)); }

  nb::tuple match_at(const Hash* path, size_t length) const {
    std::vector<int64_t> own(nodes_, 0), own_l1(nodes_, 0);
    std::vector<uint64_t> any(words_), l1(words_);
    for (int w = 0; w < words_; ++w) {
      const int in_word = std::min(64, nodes_ - 64 * w);
      any[w] = l1[w] = in_word == 64 ? ~uint64_t{0} : (uint64_t{1} << in_word) - 1;
    }
    size_t i = 0;
    for (; i < length; ++i) {
      auto it = slot_.find(path[i]);
      if (it == slot_.end()) break;
      const size_t base = size_t{it->second} * words_;
      for (int w = 0; w < words_; ++w) {
        const uint64_t tier1 = l1_[base + w], either = tier1 | l2_[base + w];
        settle(any[w] & ~either, w, i, own);
        settle(l1[w] & ~tier1, w, i, own_l1);
        any[w] &= either;
        l1[w] &= tier1;
      }
    }
    for (int w = 0; w < words_; ++w) {
      settle(any[w], w, i, own);
      settle(l1[w], w, i, own_l1);
    }
    return nb::make_tuple(i, nb::cast(own), nb::cast(own_l1));
  }

  // Which tiers of ``node`` hold ``block``: (L1, L2).
  std::pair<bool, bool> tiers(Hash h, int node) const {
    check_node(node);
    const size_t at = lookup(h) * words_ + node / 64;
    const uint64_t bit = uint64_t{1} << (node % 64);
    return {(l1_[at] & bit) != 0, (l2_[at] & bit) != 0};
  }

  std::vector<int> holders(Hash h) const {
    const size_t base = lookup(h) * words_;
    std::vector<int> out;
    for (int n = 0; n < nodes_; ++n) {
      if (((l1_[base + n / 64] | l2_[base + n / 64]) >> (n % 64)) & 1) out.push_back(n);
    }
    return out;
  }

  Hashes blocks_on(int node) const {
    check_node(node);
    Hashes out;
    for (uint32_t s = 1; s < hash_.size(); ++s) {
      if (((l1_[s * words_ + node / 64] | l2_[s * words_ + node / 64]) >> (node % 64)) & 1) {
        out.push_back(hash_[s]);
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

  // Bytes of the tables (slots, bitmaps, the hash map's buckets, free list), for the bench.
  size_t memory() const {
    return (hash_.capacity() + stamp_.capacity()) * 8 + (l1_.capacity() + l2_.capacity()) * 8 +
           free_.capacity() * 4 + slot_.bucket_count() * (sizeof(std::pair<Hash, uint32_t>) + 8);
  }

  // Throws std::logic_error where the map, the slots, the bitmaps and the counters disagree.
  void check() const {
    auto fail = [](const std::string& what) { throw std::logic_error(what); };
    if (hash_[0] != 0 || !unused(0)) fail("slot 0 is reserved");
    std::vector<char> is_free(hash_.size(), 0);
    for (uint32_t s : free_) {
      if (s == 0 || s >= hash_.size() || is_free[s]) fail("free list corrupt");
      is_free[s] = 1;
      if (hash_[s] != 0 || !unused(s)) fail("free slot " + std::to_string(s) + " in use");
    }
    if (slot_.size() + free_.size() != hash_.size() - 1) fail("a slot leaked");
    for (const auto& [h, s] : slot_) {
      if (s == 0 || s >= hash_.size() || is_free[s] || hash_[s] != h) fail("map and slots differ");
      if (unused(s)) fail("a block held by no node");
    }
    for (int n = 0; n < nodes_; ++n) {
      size_t a = 0, b = 0, c = 0;
      for (uint32_t s = 1; s < hash_.size(); ++s) {
        const uint64_t x = l1_[s * words_ + n / 64] >> (n % 64) & 1;
        const uint64_t y = l2_[s * words_ + n / 64] >> (n % 64) & 1;
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

  bool unused(uint32_t s) const {
    for (int w = 0; w < words_; ++w) {
      if (l1_[size_t{s} * words_ + w] | l2_[size_t{s} * words_ + w]) return false;
    }
    return true;
  }

  uint32_t allocate() {
    if (!free_.empty()) {
      const uint32_t s = free_.back();
      free_.pop_back();
      return s;
    }
    hash_.push_back(0);
    stamp_.push_back(0);
    l1_.resize(hash_.size() * words_, 0);
    l2_.resize(hash_.size() * words_, 0);
    return static_cast<uint32_t>(hash_.size() - 1);
  }

  // Freed slots are handed out lowest first: a run freed together and stored again gets
  // consecutive slots again.
  void release(std::vector<uint32_t>& freed) {
    std::sort(freed.begin(), freed.end(), std::greater<>());
    free_.insert(free_.end(), freed.begin(), freed.end());
  }

  void grow_words(int words) {
    std::vector<uint64_t> l1(hash_.size() * words, 0), l2(hash_.size() * words, 0);
    for (size_t s = 0; s < hash_.size(); ++s) {
      for (int w = 0; w < words_; ++w) {
        l1[s * words + w] = l1_[s * words_ + w];
        l2[s * words + w] = l2_[s * words_ + w];
      }
    }
    l1_.swap(l1);
    l2_.swap(l2);
    words_ = words;
  }

  // Nodes of word ``w`` whose bits are in ``dead`` hold ``at`` leading blocks.
  static void settle(uint64_t dead, int w, size_t at, std::vector<int64_t>& out) {
    while (dead) {
      out[64 * w + __builtin_ctzll(dead)] = static_cast<int64_t>(at);
      dead &= dead - 1;
    }
  }

  size_t page_size_;
  EventTypes types_;
  Counts counts_;
  int nodes_ = 0, words_ = 0;
  HashMap<uint32_t> slot_;
  Hashes hash_;
  std::vector<uint64_t> l1_, l2_;
  std::vector<uint32_t> free_;
  std::vector<size_t> held_l1_, held_l2_, held_any_;
  // Per slot, the store() call that last touched it: finds a hash repeated within one event.
  std::vector<uint64_t> stamp_;
  uint64_t stores_ = 0;
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
      .def("apply_batch", &Tree::apply_batch, nb::arg("node"), nb::arg("events"))
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
