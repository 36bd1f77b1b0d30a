// The host tier eviction order (host_order.h): two LRU lists threaded through one node pool,
// a block's node found by hash, so touching, inserting, regrouping and removing are O(1).
#include "host_order.h"

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <utility>

namespace evinfra {

void HostOrder::link_back(int32_t i, uint8_t g) {
  Node& n = nodes_[i];
  n.group = g;
  n.prev = tail_[g];
  n.next = kEnd;
  if (tail_[g] != kEnd) {
    nodes_[tail_[g]].next = i;
  } else {
    head_[g] = i;
  }
  tail_[g] = i;
}

void HostOrder::unlink(int32_t i) {
  Node& n = nodes_[i];
  if (n.prev != kEnd) {
    nodes_[n.prev].next = n.next;
  } else {
    head_[n.group] = n.next;
  }
  if (n.next != kEnd) {
    nodes_[n.next].prev = n.prev;
  } else {
    tail_[n.group] = n.prev;
  }
}

void HostOrder::touch(Hash h) {
  auto [it, fresh] = entry_.try_emplace(h, kPositive);
  if (!fresh && it->second >= 0) {
    // The block's group is the positive set's (apply_hints keeps it so): moved to its end.
    const int32_t i = it->second;
    unlink(i);
    link_back(i, nodes_[i].group);
    return;
  }
  const bool positive = !fresh;  // an entry without a node: a positive block
  int32_t i;
  if (!free_.empty()) {
    i = free_.back();
    free_.pop_back();
  } else {
    if (nodes_.size() >= static_cast<size_t>(INT32_MAX)) {
      if (fresh) entry_.erase(it);
      throw std::length_error("host order full");
    }
    i = static_cast<int32_t>(nodes_.size());
    nodes_.push_back(Node{});
  }
  Node& n = nodes_[i];
  n.h = h;
  n.positive = positive;
  n.mark = 0;
  it.value() = i;
  ++size_;
  link_back(i, group(positive));
}

void HostOrder::remove(Hash h) {
  auto it = entry_.find(h);
  if (it == entry_.end() || it->second < 0) return;
  const int32_t i = it->second;
  if (nodes_[i].positive) {
    it.value() = kPositive;
  } else {
    entry_.erase(it);
  }
  unlink(i);
  free_.push_back(i);
  --size_;
}

void HostOrder::set_positive(Hash h, bool on, uint32_t mark, Hashes& moving) {
  if (on) {
    auto [it, fresh] = entry_.try_emplace(h, kPositive);
    if (fresh) {
      ++positives_;
      return;
    }
    if (it->second < 0) return;
    Node& n = nodes_[it->second];
    if (n.positive) return;
    n.positive = 1;
    ++positives_;
    if (group(true) != n.group && n.mark != mark) {
      n.mark = mark;
      moving.push_back(h);
    }
    return;
  }
  auto it = entry_.find(h);
  if (it == entry_.end()) return;
  if (it->second < 0) {
    entry_.erase(it);
    --positives_;
    return;
  }
  Node& n = nodes_[it->second];
  if (!n.positive) return;
  n.positive = 0;
  --positives_;
  if (n.group != 0 && n.mark != mark) {
    n.mark = mark;
    moving.push_back(h);
  }
}

void HostOrder::move(Hashes& moving, uint8_t src, const Arrange& arrange) {
  if (moving.empty()) return;
  if (arrange) {
    Hashes arranged = moving;
    try {
      arrange(arranged);
    } catch (...) {  // the blocks still move (in hint order): the groups stay the set's
      join(moving, src);
      throw;
    }
    moving.swap(arranged);
  }
  join(moving, src);
}

void HostOrder::join(const Hashes& moving, uint8_t src) {
  for (Hash h : moving) {
    auto it = entry_.find(h);
    // a bad arrangement: a block not in the order, or not in ``src``
    if (it == entry_.end() || it->second < 0 || nodes_[it->second].group != src) continue;
    unlink(it->second);
    link_back(it->second, static_cast<uint8_t>(1 - src));
  }
}

void HostOrder::apply_hints(const Hashes& positive, const Hashes& zero, bool replace,
                            const Arrange& arrange) {
  if (replace) {
    reset_hints(positive);
    return;
  }
  // Most hinted blocks are not in host memory: only those whose group changes move, once
  // each, the positive batch before the zero one.
  Hashes moving;
  uint32_t mark = ++epoch_;
  for (Hash h : positive) set_positive(h, true, mark, moving);
  move(moving, 0, arrange);
  moving.clear();
  mark = ++epoch_;
  for (Hash h : zero) set_positive(h, false, mark, moving);
  move(moving, 1, arrange);
}

void HostOrder::reset_hints(const Hashes& positive) {
  for (auto it = entry_.begin(); it != entry_.end();) {
    if (it->second < 0) {
      it = entry_.erase(it);
    } else {
      nodes_[it->second].positive = 0;
      ++it;
    }
  }
  positives_ = 0;
  Hashes unused;
  for (Hash h : positive) set_positive(h, true, 0, unused);
  std::vector<int32_t> all;
  all.reserve(size_);
  for (int32_t i = first(); i != kEnd; i = next(i)) all.push_back(i);
  head_[0] = head_[1] = tail_[0] = tail_[1] = kEnd;
  for (int32_t i : all) link_back(i, group(nodes_[i].positive));
}

void HostOrder::clear() {
  entry_.clear();
  nodes_.clear();
  free_.clear();
  size_ = positives_ = 0;
  head_[0] = head_[1] = tail_[0] = tail_[1] = kEnd;
}

Hashes HostOrder::victims() const {
  Hashes out;
  out.reserve(size_);
  for (int32_t i = first(); i != kEnd; i = next(i)) out.push_back(nodes_[i].h);
  return out;
}

Hashes HostOrder::positive_list() const {
  Hashes out;
  out.reserve(positives_);
  for (const auto& kv : entry_) {
    if (kv.second == kPositive || (kv.second >= 0 && nodes_[kv.second].positive)) {
      out.push_back(kv.first);
    }
  }
  return out;
}

std::string HostOrder::check() const {
  size_t seen = 0;
  for (uint8_t g = 0; g < 2; ++g) {
    int32_t prev = kEnd;
    for (int32_t i = head_[g]; i != kEnd; prev = i, i = nodes_[i].next) {
      const Node& n = nodes_[i];
      if (++seen > size_) return "a list holds more blocks than the index";
      if (n.group != g || n.prev != prev) return "a broken list";
      auto it = entry_.find(n.h);
      if (it == entry_.end() || it->second != i) return "a listed block outside the index";
      if (aware_ && g == 0 && n.positive) return "a positive block in the zero group";
      if (aware_ && g == 1 && !n.positive) return "a zero-count block in the positive group";
      if (!aware_ && g == 1) return "plain LRU has one group";
    }
    if (tail_[g] != prev) return "a list's tail is not its last block";
  }
  if (seen != size_) return "an indexed block in no list";
  size_t nodes = 0, positives = 0;
  for (const auto& kv : entry_) {
    if (kv.second == kPositive) {
      ++positives;
    } else if (kv.second < 0 || static_cast<size_t>(kv.second) >= nodes_.size() ||
               nodes_[kv.second].h != kv.first) {
      return "an index entry that is no block's node";
    } else {
      ++nodes;
      positives += nodes_[kv.second].positive;
    }
  }
  if (nodes != size_) return "an indexed block in no list";
  if (positives != positives_) return "the positive count";
  return "";
}

void bind_host_order(nb::module_& m) {
  nb::class_<HostOrder>(m, "HostOrder",
                        "An engine's host tier order: zero-count blocks first, LRU within each "
                        "group (paper 5.3, Algorithm E.2 lines 16-21).")
      .def(nb::init<bool>(), nb::arg("count_aware"))
      .def_prop_ro("count_aware", &HostOrder::count_aware)
      .def("__len__", &HostOrder::size)
      .def("__contains__", &HostOrder::contains, nb::arg("block"))
      .def(
          "touch_all",
          [](HostOrder& o, nb::handle blocks) {
            HostOrder::Busy busy(o);
            HashSeq seq(blocks);
            for (size_t i = 0; i < seq.size(); ++i) o.touch(seq[i]);
          },
          nb::arg("blocks"), "Insert each block, or mark it most recently used, in turn.")
      .def(
          "remove_all",
          [](HostOrder& o, nb::handle blocks) {
            HostOrder::Busy busy(o);
            HashSeq seq(blocks);
            for (size_t i = 0; i < seq.size(); ++i) o.remove(seq[i]);
          },
          nb::arg("blocks"), "Take the blocks out of the order, held or not.")
      .def(
          "apply_hints",
          [](HostOrder& o, nb::handle positive, nb::handle zero, bool replace,
             nb::object arrange) {
            HostOrder::Busy busy(o);
            HostOrder::Arrange hook;
            if (!arrange.is_none()) {
              hook = [&arrange](Hashes& batch) {
                nb::object got = arrange(nb::cast(batch));
                batch = HashSeq(got).all();
              };
            }
            o.apply_hints(HashSeq(positive).all(), HashSeq(zero).all(), replace, hook);
          },
          nb::arg("positive"), nb::arg("zero"), nb::arg("replace"), nb::arg("arrange").none(),
          "Regroup the blocks whose count crossed zero; ``arrange`` (called with a list, "
          "returning one) orders each batch of moving blocks before it joins its group.")
      .def(
          "reset_hints", [](HostOrder& o, nb::handle positive) {
            HostOrder::Busy busy(o);
            o.reset_hints(HashSeq(positive).all());
          },
          nb::arg("positive"), "Replace the positive set wholesale.")
      .def("victims", &HostOrder::victims, "Every block in eviction order.")
      .def("is_positive", &HostOrder::is_positive, nb::arg("block"))
      .def("positive_count", &HostOrder::positive_count)
      .def("positive_list", &HostOrder::positive_list,
           "The positive set, in no particular order.")
      .def("check", &HostOrder::check, "An empty string, or the first broken invariant.");
}

}  // namespace evinfra
