// The host tier eviction order of an engine (paper 5.3, Algorithm E.2 lines 16-21): blocks
// with a zero count first, LRU within each group, the positive set learnt from the control
// plane's hints. Shared by the Python HostEvictionOrder (directory/eviction.py) and the fake
// engine's cache (cache.cpp), which keeps one inside.
#pragma once

#include <Python.h>

#include <functional>
#include <stdexcept>
#include <string>

#include "common.h"

namespace evinfra {

// A Python sequence of block hashes read in place: a list or tuple is indexed without a copy
// (a fake engine's path is a list of up to ~1,600 blocks, of which most calls read a few);
// any other iterable is listed once. Elements are converted when read.
class HashSeq {
 public:
  explicit HashSeq(nb::handle seq)
      : fast_(nb::steal(PySequence_Fast(seq.ptr(), "expected a sequence of block hashes"))) {
    if (!fast_.is_valid()) throw nb::python_error();
  }
  size_t size() const { return static_cast<size_t>(PySequence_Fast_GET_SIZE(fast_.ptr())); }
  Hash operator[](size_t i) const {
    if (i >= size()) throw nb::index_error("a sequence of block hashes shrank while read");
    PyObject* o = PySequence_Fast_GET_ITEM(fast_.ptr(), i);
    Hash h;
    if (exact_hash(o, h)) return h;
    // Held across the conversion: an element's __index__ is Python code.
    nb::object item = nb::borrow(o);
    long long v = PyLong_AsLongLong(item.ptr());
    if (v == -1 && PyErr_Occurred()) throw nb::python_error();
    return v;
  }
  Hashes slice(size_t a, size_t b) const {
    Hashes out;
    out.reserve(b > a ? b - a : 0);
    for (size_t i = a; i < b; ++i) out.push_back((*this)[i]);
    return out;
  }
  Hashes all() const { return slice(0, size()); }

 private:
  nb::object fast_;
};

class HostOrder {
 public:
  // Orders one batch of blocks changing group before they join it (given in hint order).
  using Arrange = std::function<void(Hashes&)>;
  static constexpr int32_t kEnd = -1;

  explicit HostOrder(bool count_aware) : aware_(count_aware) {}

  // Held by every native call that changes the order (or the cache that keeps it) or reads
  // a Python sequence: Python code that runs inside one (an ``arrange`` callback, an
  // element's __index__) may not call in and change what the call is walking.
  class Busy {
   public:
    explicit Busy(const HostOrder& o) : o_(o) {
      if (o.busy_) throw std::runtime_error("a native cache call made from inside another");
      o.busy_ = true;
    }
    ~Busy() { o_.busy_ = false; }
    Busy(const Busy&) = delete;
    Busy& operator=(const Busy&) = delete;

   private:
    const HostOrder& o_;
  };

  bool count_aware() const { return aware_; }
  size_t size() const { return size_; }
  bool contains(Hash h) const {
    auto it = entry_.find(h);
    return it != entry_.end() && it->second >= 0;
  }
  bool is_positive(Hash h) const {
    auto it = entry_.find(h);
    return it != entry_.end() && (it->second == kPositive || nodes_[it->second].positive);
  }
  size_t positive_count() const { return positives_; }
  Hashes positive_list() const;

  // Insert the block, or mark it most recently used, in the group the positive set says.
  void touch(Hash h);
  // Take the block out of the order, held or not.
  void remove(Hash h);
  // Regroup the blocks whose count crossed zero: ``positive`` joins the set (and the blocks
  // held in the zero group move), then ``zero`` leaves it (the blocks held in the positive
  // group move). A moving block joins its new group as its newest entry, each batch in the
  // order ``arrange`` gives (hint order without it). ``replace``: reset_hints(positive).
  void apply_hints(const Hashes& positive, const Hashes& zero, bool replace,
                   const Arrange& arrange);
  // Replace the positive set wholesale; every block rejoins its group in its old order.
  void reset_hints(const Hashes& positive);
  void clear();

  // Eviction order, as a cursor: the zero group, then the positive group.
  int32_t first() const { return head_[0] != kEnd ? head_[0] : head_[1]; }
  int32_t next(int32_t i) const {
    const Node& n = nodes_[i];
    return n.next != kEnd || n.group == 1 ? n.next : head_[1];
  }
  Hash at(int32_t i) const { return nodes_[i].h; }
  Hashes victims() const;

  // Empty if the lists, the index and the groups agree with the positive set.
  std::string check() const;

 private:
  struct Node {
    Hash h;
    int32_t prev, next;
    uint8_t group;     // 0: zero count, 1: positive (always 0 in plain LRU)
    uint8_t positive;  // in the positive set
    uint32_t mark;     // the move that last collected it (a batch names a block once)
  };
  // An entry's value when the block is positive but not in the order.
  static constexpr int32_t kPositive = -2;

  uint8_t group(bool positive) const { return aware_ && positive ? 1 : 0; }
  void link_back(int32_t i, uint8_t g);
  void unlink(int32_t i);
  // Joins the positive set (``on``) or leaves it; a block in the order whose group changes
  // with it is collected into ``moving`` (once per ``mark``).
  void set_positive(Hash h, bool on, uint32_t mark, Hashes& moving);
  void move(Hashes& moving, uint8_t src, const Arrange& arrange);
  // The blocks of ``moving`` still in group ``src`` join the other group's end, in order.
  void join(const Hashes& moving, uint8_t src);

  bool aware_;
  // One probe per block for both facts a block has here: its node in the order (>= 0), and
  // whether it is positive (the node's flag, or kPositive for a block not in the order).
  HashMap<int32_t> entry_;
  size_t size_ = 0;       // blocks in the order
  size_t positives_ = 0;  // blocks in the positive set
  BigVector<Node> nodes_;
  std::vector<int32_t> free_;
  int32_t head_[2] = {kEnd, kEnd};
  int32_t tail_[2] = {kEnd, kEnd};
  uint32_t epoch_ = 0;
  mutable bool busy_ = false;
};

}  // namespace evinfra
