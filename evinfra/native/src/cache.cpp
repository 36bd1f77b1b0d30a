// One fake engine's KV: L1 (GPU) and L2 (host) as a radix tree of block segments (paper 4.2,
// 5.3). drivers/fake/cache.py states the model and its invariants; this is its body, call for
// call the former pure-Python cache (kept as the reference in
// tests/drivers/fake/reference_cache.py, which tests/property/test_cache_machine.py compares it
// with), down to the tie-breaks: the L1 heap's (access, -depth, seq), which half of a split
// keeps the segment (its older heap entries stay valid or void with it), the host order's
// leaf-first regrouping and the host eviction passes.
//
// The calls return what the KV events must say (removed blocks, stored ranges); the Python
// shell builds the events.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "host_order.h"

namespace evinfra {
namespace {

// Token quantities stay far from int64 overflow: sizes up to 2^53 tokens, pages up to 2^20.
constexpr int64_t kMaxTokens = int64_t{1} << 53;
constexpr int64_t kMaxPage = int64_t{1} << 20;
constexpr int32_t kRoot = 0;

int64_t floordiv(int64_t a, int64_t b) {  // Python's a // b, for b > 0
  const int64_t q = a / b;
  return (a % b != 0 && a < 0) ? q - 1 : q;
}

int64_t tokens_arg(int64_t v, const char* what) {
  if (v < -kMaxTokens || v > kMaxTokens) throw nb::value_error(what);
  return v;
}

double now_arg(double now) {
  if (std::isnan(now)) throw nb::value_error("now is NaN");
  return now;
}

struct Seg {
  Hashes hashes;
  int64_t depth = 0;  // index of the first block in every path through this segment
  int32_t parent = -1;
  int32_t slot = -1;  // its index in the parent's children
  std::vector<int32_t> children;
  bool alive = false;
  bool l1 = false, l2 = false;
  int64_t lock = 0;  // requests pinning it (pins cover whole path prefixes)
  double access = 0.0;
  int64_t l1_kids = 0;  // children held in L1
  uint32_t gen = 0;     // bumped when it leaves the tree: voids its heap entries for good
  int64_t scratch = 0;  // zero between calls: blocks taken by an eviction pass, or hinted
};

// An L1 eviction candidate, checked when popped (lazy deletion).
struct Entry {
  double access;
  int64_t neg_depth;
  uint64_t seq;
  int32_t seg;
  uint32_t gen;
};

// std's heap is a max-heap: "later" on (access, -depth, seq) makes it pop the least.
struct Later {
  bool operator()(const Entry& a, const Entry& b) const {
    if (a.access != b.access) return a.access > b.access;
    if (a.neg_depth != b.neg_depth) return a.neg_depth > b.neg_depth;
    return a.seq > b.seq;
  }
};

class Cache {
 public:
  Cache(int64_t page, int64_t l1_tokens, int64_t l2_tokens, bool count_aware)
      : page_(page), l1_cap_(l1_tokens), l2_cap_(l2_tokens), order_(count_aware) {
    if (page < 1 || page > kMaxPage) throw nb::value_error("page_size out of range");
    if (l1_tokens < 0 || l1_tokens > kMaxTokens || l2_tokens < 0 || l2_tokens > kMaxTokens) {
      throw nb::value_error("capacity out of range");
    }
    clear();
  }

  void clear() {
    segs_.clear();
    free_.clear();
    seg_of_.clear();
    heap_.clear();
    seq_ = 0;
    order_.clear();
    reserved_ = l1_blocks_ = l2_blocks_ = locked_l1_ = 0;
    Seg& root = segs_[alloc()];
    root.l1 = root.l2 = true;
    root.lock = 1;
  }

  // -- sizes --------------------------------------------------------------------------------

  int64_t page() const { return page_; }
  int64_t l1_capacity() const { return l1_cap_; }
  int64_t l2_capacity() const { return l2_cap_; }
  int64_t reserved() const { return reserved_; }
  int64_t l1_blocks() const { return l1_blocks_; }
  int64_t l2_blocks() const { return l2_blocks_; }
  int64_t locked_l1() const { return locked_l1_; }
  int64_t l1_used() const { return l1_blocks_ * page_ + reserved_; }
  int64_t l2_used() const { return l2_blocks_ * page_; }
  int64_t free() const { return l1_cap_ - l1_used(); }
  int64_t kv_room() const { return free() + (l1_blocks_ - locked_l1_) * page_; }
  HostOrder& order() { return order_; }

  bool make_room(int64_t tokens, Hashes& removed) {
    tokens_arg(tokens, "tokens out of range");
    const int64_t short_ = tokens - free();
    if (short_ > 0) evict_l1((short_ + page_ - 1) / page_, removed);
    return free() >= tokens;
  }

  bool reserve(int64_t tokens, Hashes& removed) {
    if (!make_room(tokens, removed)) return false;
    reserved_ += tokens;
    return true;
  }

  void release(int64_t tokens) {
    tokens_arg(tokens, "tokens out of range");
    if (reserved_ - tokens < -(int64_t{1} << 62) || reserved_ - tokens > (int64_t{1} << 62)) {
      throw nb::value_error("reserved tokens out of range");
    }
    reserved_ -= tokens;
  }

  // -- queries ------------------------------------------------------------------------------

  int64_t prefix(const HashSeq& path, std::optional<int64_t> limit) const {
    const int64_t len = static_cast<int64_t>(path.size());
    if (limit && *limit < 0) throw nb::value_error("negative limit");
    const int64_t n = limit ? std::min(*limit, len) : len;
    // Binary search: each tier, hence the tree, is prefix-closed.
    if (n == 0 || !held(path[0])) return 0;
    if (held(path[n - 1])) return n;
    int64_t lo = 1, hi = n - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (held(path[mid - 1])) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    return lo;
  }

  int64_t tier_prefix(const HashSeq& path, int64_t k, bool in_l1) const {
    check_count(path, k);
    if (k == 0) return 0;
    int32_t s = seg_at(path[k - 1]);
    int64_t res = k;
    while (s != kRoot && !(in_l1 ? segs_[s].l1 : segs_[s].l2)) {
      res = segs_[s].depth;
      s = segs_[s].parent;
    }
    return res;
  }

  Hashes blocks(bool in_l1) const {
    Hashes out;
    for (const auto& kv : seg_of_) {
      const Seg& s = segs_[kv.second];
      if (in_l1 ? s.l1 : s.l2) out.push_back(kv.first);
    }
    return out;
  }

  // -- pins ---------------------------------------------------------------------------------

  void lock(const HashSeq& path, int64_t n, double now) {
    check_count(path, n);
    now_arg(now);
    lock_up(boundary(path, n), 0, now);
  }

  void extend_lock(const HashSeq& path, int64_t old, int64_t new_, double now) {
    if (new_ <= old) return;
    check_count(path, new_);
    if (old < 0) throw nb::value_error("negative block count");
    now_arg(now);
    lock_up(boundary(path, new_), old, now);
  }

  void unlock(const HashSeq& path, int64_t n, double now) {
    check_count(path, n);
    now_arg(now);
    if (n > 0) {  // a release without its pin would break the counts: refused up front
      for (int32_t s = seg_at(path[n - 1]); s != kRoot; s = segs_[s].parent) {
        if (segs_[s].lock < 1) throw nb::value_error("unlock of a path that is not pinned");
      }
    }
    unlock_up(path, n, now);
  }

  // -- stores -------------------------------------------------------------------------------

  struct Inserted {
    int64_t k, l1p, stop1, l2p, stop2;
    Hashes removed_l1, removed_l2;
  };

  Inserted insert(const HashSeq& path, int64_t n, double now) {
    Inserted r{};
    r.k = extend(path, n, now, [&](int64_t k, const Hashes& fresh) {
      r.l1p = tier_prefix(path, k, true);
      r.stop1 = r.l1p + room_l1(n - r.l1p, r.removed_l1);
      r.l2p = tier_prefix(path, k, false);
      r.stop2 = r.l2p + room_l2(r.stop1 - r.l2p, r.removed_l2);
      const int64_t l1p = r.l1p, stop1 = r.stop1, l2p = r.l2p, stop2 = r.stop2;
      for (int32_t s : range(path, l1p, std::min(k, stop1))) {
        Seg& seg = segs_[s];
        seg.l1 = true;
        l1_blocks_ += len(s);
        locked_l1_ += len(s);
        segs_[seg.parent].l1_kids += 1;
      }
      for (int32_t s : range(path, l2p, std::min(k, stop2))) {
        segs_[s].l2 = true;
        l2_blocks_ += len(s);
      }
      if (stop1 > k) {
        int32_t parent = boundary(path, k);
        const auto at = [&](int64_t j) { return fresh.begin() + (j - k); };
        if (stop2 > k) parent = new_seg(parent, Hashes(at(k), at(stop2)), k, true, now);
        const int64_t from = std::max(k, stop2);
        if (stop1 > from) new_seg(parent, Hashes(at(from), at(stop1)), from, false, now);
      }
      return stop1;
    });
    return r;
  }

  // Host copies only: what a peer fetch brings when L1 has no room for it (the pages land in
  // host slots, as the SGLang engine's do; the request's admission loads them back). Held
  // L1-only blocks of path[:n] are written through, new ones stored as host-only segments,
  // as L2 room allows, from the front.
  struct Stored {
    int64_t k, l2p, stop2;
    Hashes removed_l2;
  };

  Stored store_host(const HashSeq& path, int64_t n, double now) {
    Stored r{};
    r.k = extend(path, n, now, [&](int64_t k, const Hashes& fresh) {
      r.l2p = tier_prefix(path, k, false);
      r.stop2 = r.l2p + room_l2(n - r.l2p, r.removed_l2);
      for (int32_t s : range(path, r.l2p, std::min(k, r.stop2))) {
        segs_[s].l2 = true;
        l2_blocks_ += len(s);
      }
      if (r.stop2 > k) {
        const int32_t s = alloc();
        Seg& seg = segs_[s];
        seg.hashes.assign(fresh.begin(), fresh.begin() + (r.stop2 - k));
        seg.depth = k;
        seg.l2 = true;
        seg.access = now;
        add_child(boundary(path, k), s);
        for (Hash h : seg.hashes) seg_of_.insert_or_assign(h, s);
        l2_blocks_ += len(s);
        order_add(s);
      }
      return r.stop2;
    });
    return r;
  }

  // -- hints --------------------------------------------------------------------------------

  void apply_hints(const Hashes& positive, const Hashes& zero, bool replace) {
    if (!order_.count_aware()) return;
    order_.apply_hints(positive, zero, replace, [this](Hashes& b) { leaf_first(b); });
  }

  // -- checks -------------------------------------------------------------------------------

  std::string check() const {
    int64_t l1 = 0, l2 = 0, locked = 0, blocks = 0;
    size_t reached = 0, host = 0;
    std::vector<int32_t> candidates;
    std::vector<int32_t> stack{kRoot};
    while (!stack.empty()) {
      const int32_t s = stack.back();
      stack.pop_back();
      if (++reached > segs_.size()) return "a cycle in the tree";
      const Seg& seg = segs_[s];
      int64_t kids = 0;
      for (size_t j = 0; j < seg.children.size(); ++j) {
        const int32_t c = seg.children[j];
        if (c <= kRoot || static_cast<size_t>(c) >= segs_.size() || !segs_[c].alive) {
          return "a child that is not a segment";
        }
        const Seg& child = segs_[c];
        if (child.hashes.empty() || child.parent != s || child.slot != static_cast<int32_t>(j)) {
          return "a child's blocks, parent or slot";
        }
        if (child.depth != seg.depth + len(s)) return "a child's depth";
        if (!child.l1 && !child.l2) return "segment held nowhere";
        if (!seg.l1 && child.l1) return "L1 not prefix-closed";
        if (!seg.l2 && child.l2) return "L2 not prefix-closed";
        if (child.lock < 0 || (s != kRoot && child.lock > seg.lock)) {
          return "a pin must cover a whole prefix";
        }
        kids += child.l1;
        stack.push_back(c);
      }
      if (seg.l1_kids != kids) return "l1_kids is not the children held in L1";
      if (seg.scratch != 0) return "scratch left set";
      if (s == kRoot) continue;
      for (Hash h : seg.hashes) {
        auto it = seg_of_.find(h);
        if (it == seg_of_.end() || it->second != s) return "a block's segment";
      }
      const int64_t n = len(s);
      blocks += n;
      l1 += n * seg.l1;
      l2 += n * seg.l2;
      locked += n * (seg.l1 && seg.lock > 0);
      if (seg.l2 && !seg.l1 && seg.lock == 0) {
        host += seg.hashes.size();
        for (Hash h : seg.hashes) {
          if (!order_.contains(h)) return "an unpinned host-only block outside the host order";
        }
      }
      if (seg.l1 && seg.lock == 0 && seg.l1_kids == 0) candidates.push_back(s);
    }
    if (reached != segs_.size() - free_.size()) return "a segment outside the tree";
    if (l1 != l1_blocks_ || l2 != l2_blocks_ || locked != locked_l1_) return "block counters";
    if (static_cast<int64_t>(seg_of_.size()) != blocks) return "a held block outside the tree";
    if (order_.size() != host) return "the host order holds other blocks";
    std::string bad = order_.check();
    if (!bad.empty()) return "host order: " + bad;
    std::vector<bool> offered(segs_.size(), false);
    for (const Entry& e : heap_) {
      if (live(e)) offered[e.seg] = true;
    }
    for (int32_t s : candidates) {
      if (!offered[s]) return "lost L1 leaf";
    }
    if (reserved_ < 0 || l1_used() > l1_cap_) return "L1 over capacity, or reserved negative";
    if (l2_used() > l2_cap_) return "L2 over capacity";
    return "";
  }

 private:
  int64_t len(int32_t s) const { return static_cast<int64_t>(segs_[s].hashes.size()); }

  // A store of path[:n] past its held prefix k: the new blocks are claimed and the held chain
  // pinned while ``body(k, fresh)`` makes room and stores; ``body`` returns where the stored
  // blocks end (those past it found no room). Returns k.
  template <class Body>
  int64_t extend(const HashSeq& path, int64_t n, double now, Body body) {
    check_count(path, n);
    now_arg(now);
    const int64_t k = prefix(path, n);
    const Hashes fresh = path.slice(static_cast<size_t>(k), static_cast<size_t>(n));
    claim(fresh);
    int64_t stop;
    try {
      lock_up(boundary(path, k), 0, now);  // room-making must not evict the chain we extend
      stop = body(k, fresh);
    } catch (...) {
      unclaim(fresh);
      throw;
    }
    for (int64_t j = std::max(k, stop); j < n; ++j) seg_of_.erase(fresh[j - k]);  // no room
    unlock_up(path, k, now);
    return k;
  }
  bool held(Hash h) const { return seg_of_.find(h) != seg_of_.end(); }

  // A path is a hash chain: its blocks past the held prefix are new, once each. They are
  // entered in the block map as unclaimed (one probe checks and places each, where their
  // segment re-points them); nothing is changed if one is held or named twice.
  static constexpr int32_t kClaimed = -1;
  void claim(const Hashes& fresh) {
    for (size_t j = 0; j < fresh.size(); ++j) {
      if (!seg_of_.try_emplace(fresh[j], kClaimed).second) {
        for (size_t i = 0; i < j; ++i) seg_of_.erase(fresh[i]);
        throw nb::value_error("a path names a held block past its held prefix, or one twice");
      }
    }
  }
  // Drops the blocks of ``fresh`` that no segment took (a call that failed part-way).
  void unclaim(const Hashes& fresh) {
    for (Hash h : fresh) {
      auto it = seg_of_.find(h);
      if (it != seg_of_.end() && it->second == kClaimed) seg_of_.erase(it);
    }
  }

  int32_t seg_at(Hash h) const {
    auto it = seg_of_.find(h);
    if (it == seg_of_.end()) throw nb::key_error("block not held");
    return it->second;
  }

  static void check_count(const HashSeq& path, int64_t n) {
    if (n < 0 || n > static_cast<int64_t>(path.size())) {
      throw nb::value_error("block count outside the path");
    }
  }

  int32_t alloc() {
    int32_t s;
    if (!free_.empty()) {
      s = free_.back();
      free_.pop_back();
    } else {
      if (segs_.size() >= static_cast<size_t>(INT32_MAX)) {
        throw std::length_error("too many segments");
      }
      s = static_cast<int32_t>(segs_.size());
      segs_.emplace_back();  // a deque: references to the other segments stay valid
    }
    Seg& seg = segs_[s];
    seg.alive = true;
    seg.depth = seg.lock = seg.l1_kids = seg.scratch = 0;
    seg.parent = seg.slot = -1;
    seg.l1 = seg.l2 = false;
    seg.access = 0.0;
    return s;
  }

  void release_seg(int32_t s) {
    Seg& seg = segs_[s];
    seg.alive = seg.l1 = seg.l2 = false;
    ++seg.gen;
    Hashes().swap(seg.hashes);
    std::vector<int32_t>().swap(seg.children);
    free_.push_back(s);
  }

  void add_child(int32_t p, int32_t c) {
    Seg& parent = segs_[p];
    segs_[c].parent = p;
    segs_[c].slot = static_cast<int32_t>(parent.children.size());
    parent.children.push_back(c);
  }

  void remove_child(int32_t c) {
    Seg& child = segs_[c];
    Seg& parent = segs_[child.parent];
    const size_t slot = static_cast<size_t>(child.slot);
    if (slot >= parent.children.size() || parent.children[slot] != c) {
      throw std::logic_error("cache tree corrupt: a child's slot");
    }
    const int32_t last = parent.children.back();
    parent.children[slot] = last;
    segs_[last].slot = static_cast<int32_t>(slot);
    parent.children.pop_back();
  }

  // ``now`` takes ``old``'s place among its parent's children.
  void replace_child(int32_t old, int32_t now) {
    Seg& o = segs_[old];
    segs_[o.parent].children[static_cast<size_t>(o.slot)] = now;
    segs_[now].parent = o.parent;
    segs_[now].slot = o.slot;
  }

  void lock_up(int32_t s, int64_t stop_depth, double now) {
    while (s != kRoot && segs_[s].depth >= stop_depth) {
      Seg& seg = segs_[s];
      if (seg.lock == 0) {
        if (seg.l1) {
          locked_l1_ += len(s);
        } else {
          order_remove(s);
        }
      }
      seg.lock += 1;
      seg.access = now;
      s = seg.parent;
    }
  }

  // Release a pin and touch the path; segments the pin no longer tells apart merge, so a
  // branch's chunks and turns do not deepen the tree forever.
  void unlock_up(const HashSeq& path, int64_t n, double now) {
    int32_t s = boundary(path, n), below = -1;
    while (s != kRoot) {
      Seg& seg = segs_[s];
      seg.lock -= 1;
      seg.access = now;
      if (seg.lock == 0) {
        if (seg.l1) {
          locked_l1_ -= len(s);
          push(s);
        } else {
          order_add(s);
        }
      }
      if (below != -1 && segs_[s].children.size() == 1) {
        const Seg& b = segs_[below];
        const Seg& cur = segs_[s];
        if (b.lock == cur.lock && b.l1 == cur.l1 && b.l2 == cur.l2) s = merge(s, below);
      }
      below = s;
      s = segs_[s].parent;
    }
  }

  int32_t new_seg(int32_t parent, Hashes hashes, int64_t depth, bool l2, double now) {
    const int32_t s = alloc();
    Seg& seg = segs_[s];
    seg.hashes = std::move(hashes);
    seg.depth = depth;
    seg.l1 = true;
    seg.l2 = l2;
    seg.access = now;
    add_child(parent, s);
    segs_[parent].l1_kids += 1;
    for (Hash h : seg.hashes) seg_of_.insert_or_assign(h, s);
    l1_blocks_ += len(s);
    if (l2) l2_blocks_ += len(s);
    push(s);
    return s;
  }

  // The segments covering path[a:b] (held), split at both ends, deepest first.
  std::vector<int32_t> range(const HashSeq& path, int64_t a, int64_t b) {
    std::vector<int32_t> out;
    if (b <= a) return out;
    boundary(path, a);
    int32_t s = boundary(path, b);
    while (s != kRoot && segs_[s].depth >= a) {
      out.push_back(s);
      s = segs_[s].parent;
    }
    return out;
  }

  // -- hints --------------------------------------------------------------------------------

  // Host blocks (held, distinct) by their segment's access time, deepest first (stable in
  // first-seen order), each segment's blocks from its tail: regrouped blocks keep eviction
  // leaf-first.
  void leaf_first(Hashes& blocks) {
    std::vector<int32_t> seen;
    for (Hash h : blocks) {
      const int32_t s = seg_at(h);
      if (segs_[s].scratch++ == 0) seen.push_back(s);
    }
    std::stable_sort(seen.begin(), seen.end(), [this](int32_t a, int32_t b) {
      const Seg& x = segs_[a];
      const Seg& y = segs_[b];
      return x.access < y.access || (x.access == y.access && x.depth > y.depth);
    });
    Hashes out;
    out.reserve(blocks.size());
    bool chosen_built = false;
    for (int32_t s : seen) {
      Seg& seg = segs_[s];
      if (seg.scratch == len(s)) {
        out.insert(out.end(), seg.hashes.rbegin(), seg.hashes.rend());
      } else {
        if (!chosen_built) {
          fresh_.clear();
          for (Hash h : blocks) fresh_.emplace(h, Unit{});
          chosen_built = true;
        }
        for (auto it = seg.hashes.rbegin(); it != seg.hashes.rend(); ++it) {
          if (fresh_.find(*it) != fresh_.end()) out.push_back(*it);
        }
      }
      seg.scratch = 0;
    }
    blocks.swap(out);
  }

  // -- eviction -----------------------------------------------------------------------------

  // How many of ``blocks`` new L1 blocks fit, after evicting what may be evicted.
  int64_t room_l1(int64_t blocks, Hashes& removed) {
    if (blocks <= 0) return 0;
    make_room(blocks * page_, removed);
    return std::max<int64_t>(0, std::min(blocks, floordiv(free(), page_)));
  }

  int64_t room_l2(int64_t blocks, Hashes& removed) {
    if (blocks <= 0) return 0;
    const int64_t cap = floordiv(l2_cap_, page_);
    const int64_t short_ = blocks - (cap - l2_blocks_);
    if (short_ > 0) evict_l2(short_, removed);
    return std::max<int64_t>(0, std::min(blocks, cap - l2_blocks_));
  }

  // Offer the segment to L1 eviction if it is an unpinned L1 leaf. An entry is checked when
  // popped: a changed access time or depth, or a segment that left the tree, voids it.
  void push(int32_t s) {
    const Seg& seg = segs_[s];
    if (!seg.l1 || seg.lock != 0 || seg.l1_kids != 0) return;
    heap_.push_back(Entry{seg.access, -seg.depth, seq_++, s, seg.gen});
    std::push_heap(heap_.begin(), heap_.end(), Later{});
    if (static_cast<int64_t>(heap_.size()) > 2 * l1_blocks_ + 1024) {
      heap_.erase(std::remove_if(heap_.begin(), heap_.end(),
                                 [this](const Entry& e) { return !live(e); }),
                  heap_.end());
      std::make_heap(heap_.begin(), heap_.end(), Later{});
    }
  }

  bool live(const Entry& e) const {
    const Seg& seg = segs_[e.seg];
    return seg.gen == e.gen && seg.alive && seg.l1 && seg.lock == 0 && seg.l1_kids == 0 &&
           seg.access == e.access && seg.depth == -e.neg_depth;
  }

  void evict_l1(int64_t blocks, Hashes& removed) {
    while (blocks > 0 && !heap_.empty()) {
      std::pop_heap(heap_.begin(), heap_.end(), Later{});
      const Entry e = heap_.back();
      heap_.pop_back();
      if (!live(e)) continue;
      int32_t s = e.seg;
      if (len(s) > blocks) s = split(s, len(s) - blocks).second;  // the tail only
      blocks -= len(s);
      removed.insert(removed.end(), segs_[s].hashes.begin(), segs_[s].hashes.end());
      drop_l1(s);
    }
  }

  void drop_l1(int32_t s) {
    Seg& seg = segs_[s];
    seg.l1 = false;
    l1_blocks_ -= len(s);
    const int32_t parent = seg.parent;
    segs_[parent].l1_kids -= 1;
    if (parent != kRoot) push(parent);
    if (seg.l2) {
      order_add(s);
      return;
    }
    // Its write-through found no room: held nowhere now (a leaf, by L2 closure).
    if (!seg.children.empty()) throw std::logic_error("cache tree corrupt: an L1-only parent");
    remove_child(s);
    for (Hash h : seg.hashes) seg_of_.erase(h);
    release_seg(s);
  }

  // Free ``blocks`` host blocks in the host order, leaves first. A pass walks the order and
  // takes each block that is the tail of a childless segment once the blocks after it are
  // taken. It stops at the first block it cannot take yet: that block is older (or
  // zero-count) and may become a leaf when this pass's victims go, so everything after it
  // waits for the next pass.
  void evict_l2(int64_t blocks, Hashes& removed) {
    const int64_t start = static_cast<int64_t>(removed.size());
    Hashes batch;
    std::vector<int32_t> taken;
    while (static_cast<int64_t>(removed.size()) - start < blocks) {
      batch.clear();
      taken.clear();
      const int64_t need = blocks - (static_cast<int64_t>(removed.size()) - start);
      for (int32_t c = order_.first(); c != HostOrder::kEnd; c = order_.next(c)) {
        const Hash h = order_.at(c);
        auto it = seg_of_.find(h);
        if (it == seg_of_.end()) throw std::logic_error("cache corrupt: a host block not held");
        Seg& seg = segs_[it->second];
        const int64_t t = seg.scratch, n = len(it->second);
        if (!seg.children.empty() || t >= n || seg.hashes[static_cast<size_t>(n - 1 - t)] != h) {
          if (!batch.empty()) break;
          continue;
        }
        if (t == 0) taken.push_back(it->second);
        seg.scratch = t + 1;
        batch.push_back(h);
        if (static_cast<int64_t>(batch.size()) == need) break;
      }
      if (batch.empty()) break;
      for (Hash h : batch) seg_of_.erase(h);
      for (int32_t s : taken) {  // each loses its last ``scratch`` blocks
        Seg& seg = segs_[s];
        const int64_t t = seg.scratch;
        seg.scratch = 0;
        if (t == len(s)) {
          remove_child(s);
          release_seg(s);
        } else {
          seg.hashes.resize(static_cast<size_t>(len(s) - t));
        }
      }
      for (Hash h : batch) order_.remove(h);
      l2_blocks_ -= static_cast<int64_t>(batch.size());
      removed.insert(removed.end(), batch.begin(), batch.end());
    }
  }

  // Deepest first: leaves are evicted before their prefix.
  void order_add(int32_t s) {
    const Hashes& hs = segs_[s].hashes;
    for (auto it = hs.rbegin(); it != hs.rend(); ++it) order_.touch(*it);
  }

  void order_remove(int32_t s) {
    for (Hash h : segs_[s].hashes) order_.remove(h);
  }

  // -- tree surgery -------------------------------------------------------------------------

  // The segment ending exactly at path[k - 1] (held), splitting one if needed.
  int32_t boundary(const HashSeq& path, int64_t k) {
    if (k == 0) return kRoot;
    const Hash h = path[k - 1];
    int32_t s = seg_at(h);
    const Seg& seg = segs_[s];
    const int64_t cut = k - seg.depth;
    if (cut < 1 || cut > len(s) || seg.hashes[static_cast<size_t>(cut - 1)] != h) {
      throw nb::value_error("the path does not follow the cache's tree");
    }
    if (cut < len(s)) s = split(s, cut).first;
    return s;
  }

  // Join ``tail``, the only child of ``head``, into one segment (same flags, pins and
  // access); the segment with more blocks survives, so only the other's are re-pointed.
  int32_t merge(int32_t head, int32_t tail) {
    Seg& h = segs_[head];
    Seg& t = segs_[tail];
    int32_t keep, gone;
    if (t.hashes.size() <= h.hashes.size()) {
      keep = head;
      gone = tail;
      for (Hash b : t.hashes) seg_of_.insert_or_assign(b, head);
      h.hashes.insert(h.hashes.end(), t.hashes.begin(), t.hashes.end());
      h.children = std::move(t.children);
      t.children.clear();
    } else {
      keep = tail;
      gone = head;
      for (Hash b : h.hashes) seg_of_.insert_or_assign(b, tail);
      t.hashes.insert(t.hashes.begin(), h.hashes.begin(), h.hashes.end());
      t.depth = h.depth;
      replace_child(head, tail);
    }
    Seg& k = segs_[keep];
    for (int32_t c : k.children) segs_[c].parent = keep;
    k.l1_kids = t.l1_kids;
    release_seg(gone);
    push(keep);
    return keep;
  }

  // Split ``s`` after its ``p``-th block; the smaller half is the new segment, so only its
  // blocks are re-pointed.
  std::pair<int32_t, int32_t> split(int32_t s, int64_t p) {
    const int32_t fresh = alloc();
    Seg& seg = segs_[s];
    Seg& nw = segs_[fresh];
    nw.l1 = seg.l1;
    nw.l2 = seg.l2;
    nw.lock = seg.lock;
    nw.access = seg.access;
    const int64_t kids = seg.l1_kids;
    const auto cut = seg.hashes.begin() + p;
    int32_t head, tail;
    if (p <= len(s) - p) {
      head = fresh;
      tail = s;
      nw.depth = seg.depth;
      replace_child(s, fresh);
      nw.hashes.assign(seg.hashes.begin(), cut);
      seg.hashes.erase(seg.hashes.begin(), cut);
    } else {
      head = s;
      tail = fresh;
      nw.children = std::move(seg.children);
      seg.children.clear();
      for (int32_t c : nw.children) segs_[c].parent = fresh;
      nw.hashes.assign(cut, seg.hashes.end());
      seg.hashes.erase(cut, seg.hashes.end());
    }
    Seg& hd = segs_[head];
    Seg& tl = segs_[tail];
    tl.depth = hd.depth + p;
    hd.children.clear();
    add_child(head, tail);
    tl.l1_kids = kids;
    hd.l1_kids = tl.l1 ? 1 : 0;
    for (Hash h : nw.hashes) seg_of_.insert_or_assign(h, fresh);
    push(tail);
    return {head, tail};
  }

  int64_t page_, l1_cap_, l2_cap_;
  int64_t reserved_ = 0, l1_blocks_ = 0, l2_blocks_ = 0, locked_l1_ = 0;
  std::deque<Seg> segs_;  // [0] is the root; freed slots are reused
  std::vector<int32_t> free_;
  HashMap<int32_t> seg_of_;  // held block -> its segment
  std::vector<Entry> heap_;
  uint64_t seq_ = 0;
  HostOrder order_;
  HashMap<Unit> fresh_;  // scratch set of one call
};

nb::tuple removal(bool ok, const Hashes& removed) { return nb::make_tuple(ok, removed); }

}  // namespace

void bind_cache(nb::module_& m) {
  nb::class_<Cache>(m, "NodeCache",
                    "One fake engine's L1 and L2 as a radix tree of block segments "
                    "(drivers/fake/cache.py is the shell that emits the KV events).")
      .def(nb::init<int64_t, int64_t, int64_t, bool>(), nb::arg("page_size"),
           nb::arg("l1_tokens"), nb::arg("l2_tokens"), nb::arg("count_aware"))
      .def("clear", [](Cache& c) {
        HostOrder::Busy busy(c.order());
        c.clear();
      })
      .def_prop_ro("order", &Cache::order, nb::rv_policy::reference_internal)
      .def_prop_ro("reserved", &Cache::reserved)
      .def_prop_ro("l1_blocks", &Cache::l1_blocks)
      .def_prop_ro("l2_blocks", &Cache::l2_blocks)
      .def_prop_ro("locked_l1", &Cache::locked_l1)
      .def_prop_ro("l1_used", &Cache::l1_used)
      .def_prop_ro("l2_used", &Cache::l2_used)
      .def_prop_ro("free", &Cache::free)
      .def_prop_ro("kv_room", &Cache::kv_room)
      .def(
          "make_room",
          [](Cache& c, int64_t tokens) {
            HostOrder::Busy busy(c.order());
            Hashes removed;
            const bool ok = c.make_room(tokens, removed);
            return removal(ok, removed);
          },
          nb::arg("tokens"), "(enough room, blocks removed from L1)")
      .def(
          "reserve",
          [](Cache& c, int64_t tokens) {
            HostOrder::Busy busy(c.order());
            Hashes removed;
            const bool ok = c.reserve(tokens, removed);
            return removal(ok, removed);
          },
          nb::arg("tokens"), "(reserved, blocks removed from L1)")
      .def(
          "release",
          [](Cache& c, int64_t tokens) {
            HostOrder::Busy busy(c.order());
            c.release(tokens);
          },
          nb::arg("tokens"))
      .def(
          "prefix",
          [](Cache& c, nb::handle path, std::optional<int64_t> limit) {
            HostOrder::Busy busy(c.order());
            return c.prefix(HashSeq(path), limit);
          },
          nb::arg("path"), nb::arg("limit").none())
      .def(
          "tier_prefix",
          [](Cache& c, nb::handle path, int64_t k, bool l1) {
            HostOrder::Busy busy(c.order());
            return c.tier_prefix(HashSeq(path), k, l1);
          },
          nb::arg("path"), nb::arg("k"), nb::arg("l1"))
      .def(
          "lock",
          [](Cache& c, nb::handle path, int64_t n, double now) {
            HostOrder::Busy busy(c.order());
            c.lock(HashSeq(path), n, now);
          },
          nb::arg("path"), nb::arg("n"), nb::arg("now"))
      .def(
          "extend_lock",
          [](Cache& c, nb::handle path, int64_t old, int64_t new_, double now) {
            HostOrder::Busy busy(c.order());
            c.extend_lock(HashSeq(path), old, new_, now);
          },
          nb::arg("path"), nb::arg("old"), nb::arg("new"), nb::arg("now"))
      .def(
          "unlock",
          [](Cache& c, nb::handle path, int64_t n, double now) {
            HostOrder::Busy busy(c.order());
            c.unlock(HashSeq(path), n, now);
          },
          nb::arg("path"), nb::arg("n"), nb::arg("now"))
      .def(
          "insert",
          [](Cache& c, nb::handle path, int64_t n, double now) {
            HostOrder::Busy busy(c.order());
            Cache::Inserted r = c.insert(HashSeq(path), n, now);
            return nb::make_tuple(r.k, r.l1p, r.stop1, r.l2p, r.stop2, r.removed_l1,
                                  r.removed_l2);
          },
          nb::arg("path"), nb::arg("n"), nb::arg("now"),
          "(held prefix, L1 prefix, L1 end, L2 prefix, L2 end, blocks removed from L1, "
          "blocks removed from L2)")
      .def(
          "store_host",
          [](Cache& c, nb::handle path, int64_t n, double now) {
            HostOrder::Busy busy(c.order());
            Cache::Stored r = c.store_host(HashSeq(path), n, now);
            return nb::make_tuple(r.k, r.l2p, r.stop2, r.removed_l2);
          },
          nb::arg("path"), nb::arg("n"), nb::arg("now"),
          "(held prefix, L2 prefix, L2 end, blocks removed from L2)")
      .def(
          "apply_hints",
          [](Cache& c, nb::handle positive, nb::handle zero, bool replace) {
            HostOrder::Busy busy(c.order());
            c.apply_hints(HashSeq(positive).all(), HashSeq(zero).all(), replace);
          },
          nb::arg("positive"), nb::arg("zero"), nb::arg("replace"))
      .def("blocks", &Cache::blocks, nb::arg("l1"))
      .def("check", &Cache::check, "An empty string, or the first broken invariant.");
}

}  // namespace evinfra
