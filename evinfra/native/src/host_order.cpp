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
  const uint8_t g = group_of(h);
  auto it = index_.find(h);
  if (it != index_.end()) {
    // The block's group is the positive set's (apply_hints keeps it so): moved to its end.
    unlink(it->second);
    link_back(it->second, g);
    return;
  }
  int32_t i;
  if (!free_.empty()) {
    i = free_.back();
    free_.pop_back();
  } else {
    if (nodes_.size() >= static_cast<size_t>(INT32_MAX)) {
      throw std::length_error("host order full");
    }
    i = static_cast<int32_t>(nodes_.size());
    nodes_.push_back(Node{});
  }
  nodes_[i].h = h;
  nodes_[i].mark = 0;
  index_.emplace(h, i);
  link_back(i, g);
}

void HostOrder::remove(Hash h) {
  auto it = index_.find(h);
  if (it == index_.end()) return;
  const int32_t i = it->second;
  index_.erase(it);
  unlink(i);
  free_.push_back(i);
}

void HostOrder::move(const Hashes& blocks, uint8_t src, const Arrange& arrange) {
  // Most hinted blocks are not in host memory: only those in ``src`` are collected, once each.
  const uint32_t mark = ++epoch_;
  Hashes moving;
  for (Hash h : blocks) {
    auto it = index_.find(h);
    if (it == index_.end()) continue;
    Node& n = nodes_[it->second];
    if (n.group != src || n.mark == mark) continue;
    n.mark = mark;
    moving.push_back(h);
  }
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
    auto it = index_.find(h);
    if (it == index_.end() || nodes_[it->second].group != src) continue;  // a bad arrangement
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
  for (Hash h : positive) positive_.emplace(h, Unit{});
  if (aware_) move(positive, 0, arrange);
  for (Hash h : zero) positive_.erase(h);
  move(zero, 1, arrange);
}

void HostOrder::reset_hints(const Hashes& positive) {
  positive_.clear();
  for (Hash h : positive) positive_.emplace(h, Unit{});
  std::vector<int32_t> all;
  all.reserve(index_.size());
  for (int32_t i = first(); i != kEnd; i = next(i)) all.push_back(i);
  head_[0] = head_[1] = tail_[0] = tail_[1] = kEnd;
  for (int32_t i : all) link_back(i, group_of(nodes_[i].h));
}

void HostOrder::clear() {
  positive_.clear();
  index_.clear();
  nodes_.clear();
  free_.clear();
  head_[0] = head_[1] = tail_[0] = tail_[1] = kEnd;
}

Hashes HostOrder::victims() const {
  Hashes out;
  out.reserve(index_.size());
  for (int32_t i = first(); i != kEnd; i = next(i)) out.push_back(nodes_[i].h);
  return out;
}

std::string HostOrder::check() const {
  size_t seen = 0;
  for (uint8_t g = 0; g < 2; ++g) {
    int32_t prev = kEnd;
    for (int32_t i = head_[g]; i != kEnd; prev = i, i = nodes_[i].next) {
      const Node& n = nodes_[i];
      if (++seen > index_.size()) return "a list holds more blocks than the index";
      if (n.group != g || n.prev != prev) return "a broken list";
      auto it = index_.find(n.h);
      if (it == index_.end() || it->second != i) return "a listed block outside the index";
      const bool pos = positive_.find(n.h) != positive_.end();
      if (aware_ && g == 0 && pos) return "a positive block in the zero group";
      if (aware_ && g == 1 && !pos) return "a zero-count block in the positive group";
      if (!aware_ && g == 1) return "plain LRU has one group";
    }
    if (tail_[g] != prev) return "a list's tail is not its last block";
  }
  if (seen != index_.size()) return "an indexed block in no list";
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
      .def(
          "is_positive",
          [](const HostOrder& o, Hash h) { return o.positive().find(h) != o.positive().end(); },
          nb::arg("block"))
      .def("positive_count", [](const HostOrder& o) { return o.positive().size(); })
      .def(
          "positive_list",
          [](const HostOrder& o) {
            Hashes out;
            out.reserve(o.positive().size());
            for (const auto& kv : o.positive()) out.push_back(kv.first);
            return out;
          },
          "The positive set, in no particular order.")
      .def("check", &HostOrder::check, "An empty string, or the first broken invariant.");
}

}  // namespace evinfra
