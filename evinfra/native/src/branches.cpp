// The branch table of the directory: Algorithm E.1's versions and rewrites and E.2's counts,
// with the eviction hints. evinfra/directory/branches.py is its shell: it hashes the requests,
// keeps the HashedPath objects and maps branch ids (str) to the handles used here.
//
// For each branch: its version, its path (the hashes only) and on each node the prefix length
// k it counts there, C[β, n] = path[:k] minus holes (the blocks the node evicted, E.2 line 20).
// For each node: R[b, n], the branches that count there, and the notes for its next hint.
//
// Every observable order is the one the former Python table had (the simulation reports depend
// on the order of a hint's blocks): its dicts are Ordered maps here, insertion order with
// deletion, and a branch's nodes are a vector in the order it was first placed on them.
#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include <nanobind/stl/vector.h>

#include "common.h"

namespace evinfra {
namespace {

// A map from a hash (or a handle) to V that iterates in insertion order, as a Python dict:
// assigning an existing key keeps its place, erasing and re-inserting a key moves it last.
// Erased entries stay as dead items until they outnumber the live ones.
template <class V>
class Ordered {
 public:
  size_t size() const { return pos_.size(); }
  bool empty() const { return pos_.empty(); }
  bool contains(Hash key) const { return pos_.find(key) != pos_.end(); }

  // d[key] = value.
  void set(Hash key, V value) {
    auto it = pos_.find(key);
    if (it != pos_.end()) {
      items_[it->second].value = value;
      return;
    }
    pos_.emplace(key, items_.size());
    items_.push_back({key, value, true});
  }

  // d.pop(key, None) is not None.
  bool erase(Hash key) {
    auto it = pos_.find(key);
    if (it == pos_.end()) return false;
    items_[it->second].live = false;
    pos_.erase(it);
    if (items_.size() > 16 && 2 * pos_.size() < items_.size()) compact();
    return true;
  }

  // Keeps the entries for which keep(key, value) holds, in their order.
  template <class P>
  void retain(P&& keep) {
    for (Item& e : items_) {
      if (e.live && !keep(e.key, e.value)) {
        e.live = false;
        pos_.erase(e.key);
      }
    }
    compact();
  }

  template <class F>
  void each(F&& f) const {
    for (const Item& e : items_)
      if (e.live) f(e.key, e.value);
  }

  // As each, until f returns true.
  template <class F>
  void each_until(F&& f) const {
    for (const Item& e : items_)
      if (e.live && f(e.key, e.value)) return;
  }

  Hashes keys() const {
    Hashes out;
    out.reserve(size());
    each([&](Hash k, const V&) { out.push_back(k); });
    return out;
  }

  // A fresh map, as Python's ``d = {}``: clearing a robin_map walks all its buckets, and a
  // node's notes can once have been large.
  void reset() { *this = Ordered(); }

 private:
  struct Item {
    Hash key;
    V value;
    bool live;
  };

  void compact() {
    size_t j = 0;
    for (size_t i = 0; i < items_.size(); ++i) {
      if (!items_[i].live) continue;
      if (i != j) {
        items_[j] = items_[i];
        pos_[items_[j].key] = j;
      }
      ++j;
    }
    items_.resize(j);
  }

  std::vector<Item> items_;
  HashMap<size_t> pos_;
};

// Where a crossing's blocks sit in a list of ints (a branch's path), if they do: `ints[at:]`.
struct Run {
  PyObject* ints = nullptr;
  size_t at = 0;
};

// The ints of `list[from:]` as hashes (signed 64-bit, as the events carry them).
Hashes read(const nb::list& list, size_t from) {
  size_t n = nb::len(list);
  Hashes out;
  out.reserve(n > from ? n - from : 0);
  for (size_t i = from; i < n; ++i) {
    PyObject* item = PyList_GET_ITEM(list.ptr(), i);
    // Only ints: converting anything else could run Python code that changes the list.
    if (!PyLong_Check(item)) throw nb::type_error("a path holds ints");
    long long v = PyLong_AsLongLong(item);
    if (v == -1 && PyErr_Occurred()) throw nb::python_error();
    out.push_back(v);
  }
  return out;
}

nb::list ints(const Hashes& hashes) {
  nb::list out = nb::steal<nb::list>(PyList_New(static_cast<Py_ssize_t>(hashes.size())));
  if (!out.is_valid()) throw nb::python_error();
  for (size_t i = 0; i < hashes.size(); ++i) {
    PyObject* v = PyLong_FromLongLong(hashes[i]);
    if (v == nullptr) throw nb::python_error();
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), v);
  }
  return out;
}

// C[β, n] on one node: path[:k] minus holes (block -> its index in the path, in the order the
// node evicted them; none when empty).
struct Counted {
  int64_t node;
  size_t k;
  Ordered<size_t> holes;
};

struct Branch {
  bool live = false;
  int64_t version = 1;
  Hashes path;
  // The same path as the shell's HashedPath.hashes: a crossing of a run of the path is noted
  // as a slice of this list, so a hint hands on the path's own ints, as the Python table did,
  // rather than making one per block.
  nb::object ints;
  std::vector<Counted> on;  // N_β, in the order the branch was first placed on each node
  // block -> its first index, for the leading `indexed` blocks of the path: evictions ask, and
  // the index grows with the path, so no eviction scans a path.
  HashMap<size_t> index;
  size_t indexed = 0;

  Counted* at(int64_t node) {
    for (Counted& c : on)
      if (c.node == node) return &c;
    return nullptr;
  }

  // Index of the first `h` in the path; -1 when it is not there.
  int64_t position(Hash h) {
    for (; indexed < path.size(); ++indexed) index.try_emplace(path[indexed], indexed);
    auto it = index.find(h);
    return it == index.end() ? -1 : static_cast<int64_t>(it->second);
  }

  // The path is rewritten after its first `keep` blocks: drop the rest from the index
  // (while `path` is still the old one).
  void cut(size_t keep) {
    for (size_t i = keep; i < indexed; ++i) {
      auto it = index.find(path[i]);
      if (it != index.end() && it->second >= keep) index.erase(it);
    }
    indexed = std::min(indexed, keep);
  }
};

struct Node {
  int64_t phase;
  HashMap<int64_t> R;       // the positive counts R[b, n]
  Ordered<Unit> branches;   // the branches with counts here (handles)
  // The blocks whose count is on the other side of zero than the last hint said (true:
  // positive now). One crossing between two hints waits as it came, in `slice`, and joins
  // `notes` only when a second one comes: a hint then hands it on as it is.
  Ordered<bool> notes;
  bool has_slice = false;
  bool slice_up = false;
  Hashes slice;
  nb::object slice_ints;  // the slice as a list of ints, when it was a run of a path
  bool hinted = false;  // notes or a slice wait
};

}  // namespace

// Outside the anonymous namespace: the tree's batches reach it (common.h).
class BranchTable {
 public:
  int64_t add_node(int64_t phase) {
    nodes_.push_back(Node{});
    nodes_.back().phase = phase;
    return static_cast<int64_t>(nodes_.size()) - 1;
  }

  int64_t phase(int64_t node) const { return nodes_[check(node)].phase; }
  void set_phase(int64_t node, int64_t phase) { nodes_[check(node)].phase = phase; }

  // -- E.1 ------------------------------------------------------------------------------

  // A new branch (version 1) on `path` (a list of ints); returns its handle.
  int64_t add_branch(nb::list path) {
    Hashes hashes = read(path, 0);
    int64_t handle;
    if (!free_.empty()) {
      handle = free_.back();
      free_.pop_back();
    } else {
      handle = static_cast<int64_t>(branches_.size());
      branches_.emplace_back();
    }
    Branch& b = branches_[handle];
    b = Branch{};
    b.live = true;
    b.path = std::move(hashes);
    b.ints = std::move(path);
    return handle;
  }

  // The branch's next path, `path`, keeps the first `keep` blocks of its path: only the blocks
  // past them are read. Fewer than the whole path kept is a rewrite: the version bumps and the
  // counts on every node are trimmed to the kept prefix (E.2 line 7). Returns the version.
  int64_t step(int64_t handle, int64_t keep, nb::list path) {
    Branch& b = get(handle);
    if (keep < 0 || static_cast<size_t>(keep) > std::min(b.path.size(), nb::len(path)))
      throw nb::value_error("keep must be within both paths");
    size_t kept = static_cast<size_t>(keep);
    Hashes tail = read(path, kept);
    if (kept < b.path.size()) {
      b.version += 1;
      std::vector<int64_t> nodes;
      for (const Counted& c : b.on) nodes.push_back(c.node);
      for (int64_t n : nodes) trim(b, handle, n, kept);
      b.cut(kept);
      b.path.resize(kept);
    }
    b.path.insert(b.path.end(), tail.begin(), tail.end());
    b.ints = std::move(path);
    return b.version;
  }

  // -- E.2 ------------------------------------------------------------------------------

  // Lines 9-10: Count(β, n, π_β). C[β, n] is a prefix minus holes, so π_β \ C is the tail
  // past k plus the holes, and C \ π_β is empty.
  void place(int64_t handle, int64_t node) {
    check(node);
    Branch& b = get(handle);
    if (b.path.empty()) return;
    Counted* c = b.at(node);
    size_t k = c != nullptr ? std::min(c->k, b.path.size()) : 0;
    Hashes holes;
    if (c != nullptr && !c->holes.empty()) {
      holes = c->holes.keys();
      c->holes.reset();
    }
    inc_all(node, b.path.data() + k, b.path.size() - k, Run{b.ints.ptr(), k});
    if (!holes.empty()) inc_all(node, holes.data(), holes.size(), Run{});
    if (c != nullptr)
      c->k = b.path.size();
    else
      b.on.push_back(Counted{node, b.path.size(), {}});
    nodes_[node].branches.set(handle, Unit{});
  }

  // Line 11: `node` holds the current version; release the branch on the other nodes of its
  // phase, in the branch's order of nodes. Returns them.
  std::vector<int64_t> settle(int64_t handle, int64_t node) {
    check(node);
    Branch& b = get(handle);
    std::vector<int64_t> released;
    if (b.at(node) == nullptr) return released;
    int64_t phase = nodes_[node].phase;
    for (const Counted& c : b.on)
      if (c.node != node && nodes_[c.node].phase == phase) released.push_back(c.node);
    for (int64_t m : released) trim(b, handle, m, 0);
    return released;
  }

  // Line 13: release every count of the branch and forget it.
  void end(int64_t handle) {
    Branch& b = get(handle);
    std::vector<int64_t> nodes;
    for (const Counted& c : b.on) nodes.push_back(c.node);
    for (int64_t n : nodes) trim(b, handle, n, 0);
    b = Branch{};
    free_.push_back(handle);
  }

  // Release(β, n) for every branch on `node` (a D->P switch, a lost node).
  void release_node(int64_t node) {
    check(node);
    for (Hash handle : nodes_[node].branches.keys()) trim(branches_[handle], handle, node, 0);
  }

  // Line 20: the node lost these blocks; zero their counts and take them out of every
  // C[β, n]. A batch is mostly runs of blocks of the same branches (a leaf segment goes at
  // once), so the holders of the previous block are asked first and the node's other
  // branches only while the block's count is not accounted for.
  void evicted(int64_t node, const Hashes& blocks) {
    Node& nd = nodes_[check(node)];
    std::vector<int64_t> emptied, recent, holders, asked;
    Hashes zeroed;
    for (Hash h : blocks) {
      auto it = nd.R.find(h);
      if (it == nd.R.end()) continue;
      size_t r = static_cast<size_t>(it->second);
      holders.clear();
      for (int64_t b : recent) {
        if (hole(b, node, h, emptied)) {
          holders.push_back(b);
          if (holders.size() == r) break;
        }
      }
      if (holders.size() < r) {
        asked.assign(recent.begin(), recent.end());
        std::sort(asked.begin(), asked.end());
        nd.branches.each_until([&](Hash b, const Unit&) {
          if (std::binary_search(asked.begin(), asked.end(), b)) return false;
          if (hole(b, node, h, emptied)) holders.push_back(b);
          return holders.size() == r;
        });
      }
      std::swap(recent, holders);
      nd.R.erase(h);
      zeroed.push_back(h);
    }
    if (!zeroed.empty()) crossed(node, zeroed.data(), zeroed.size(), false, Run{});
    for (int64_t handle : emptied) {
      Branch& b = branches_[handle];
      b.on.erase(std::remove_if(b.on.begin(), b.on.end(),
                                [&](const Counted& c) { return c.node == node; }),
                 b.on.end());
      nd.branches.erase(handle);
    }
  }

  // -- hints ------------------------------------------------------------------------------

  // The blocks whose count on `node` crossed zero since the last call (and not back):
  // (became positive, became zero), each in the order noted.
  nb::tuple take_hints(int64_t node) {
    Node& nd = nodes_[check(node)];
    nd.hinted = false;
    if (nd.has_slice) {
      nd.has_slice = false;
      nb::object blocks = nd.slice_ints.is_valid() ? std::move(nd.slice_ints) : ints(nd.slice);
      nd.slice_ints.reset();
      nd.slice.clear();
      return nd.slice_up ? nb::make_tuple(blocks, nb::list()) : nb::make_tuple(nb::list(), blocks);
    }
    Hashes pos, zero;
    nd.notes.each([&](Hash h, bool up) { (up ? pos : zero).push_back(h); });
    nd.notes.reset();
    return nb::make_tuple(ints(pos), ints(zero));
  }

  std::vector<int64_t> hinted_nodes() const {
    std::vector<int64_t> out;
    for (size_t i = 0; i < nodes_.size(); ++i)
      if (nodes_[i].hinted) out.push_back(static_cast<int64_t>(i));
    return out;
  }

  // How many blocks wait to be hinted to `node`.
  size_t waiting(int64_t node) const {
    const Node& nd = nodes_[check(node)];
    return nd.has_slice ? nd.slice.size() : nd.notes.size();
  }

  // -- queries ----------------------------------------------------------------------------

  int64_t version(int64_t handle) { return get(handle).version; }

  std::vector<int64_t> nodes_of(int64_t handle) {
    std::vector<int64_t> out;
    for (const Counted& c : get(handle).on) out.push_back(c.node);
    std::sort(out.begin(), out.end());
    return out;
  }

  Hashes counted(int64_t handle, int64_t node) {
    check(node);
    Branch& b = get(handle);
    Hashes out;
    const Counted* c = b.at(node);
    if (c == nullptr) return out;
    for (size_t i = 0; i < std::min(c->k, b.path.size()); ++i)
      if (!c->holes.contains(b.path[i])) out.push_back(b.path[i]);
    return out;
  }

  int64_t count(Hash block, int64_t node) const {
    const HashMap<int64_t>& R = nodes_[check(node)].R;
    auto it = R.find(block);
    return it == R.end() ? 0 : it->second;
  }

  nb::dict counts(int64_t node) const {
    nb::dict out;
    for (const auto& [h, r] : nodes_[check(node)].R) out[nb::int_(h)] = nb::int_(r);
    return out;
  }

  std::vector<int64_t> branches_on(int64_t node) const {
    return nodes_[check(node)].branches.keys();
  }

 private:
  size_t check(int64_t node) const {
    if (node < 0 || static_cast<size_t>(node) >= nodes_.size())
      throw nb::index_error(("no node " + std::to_string(node)).c_str());
    return static_cast<size_t>(node);
  }

  Branch& get(int64_t handle) {
    if (handle < 0 || static_cast<size_t>(handle) >= branches_.size() || !branches_[handle].live)
      throw nb::key_error(("no branch handle " + std::to_string(handle)).c_str());
    return branches_[handle];
  }

  // Takes `h` out of C[β, n] if it is there; notes β in `emptied` if that empties it.
  bool hole(int64_t handle, int64_t node, Hash h, std::vector<int64_t>& emptied) {
    Branch& b = branches_[handle];
    Counted* c = b.at(node);
    if (c == nullptr) return false;
    int64_t i = b.position(h);
    if (i < 0 || static_cast<size_t>(i) >= c->k || c->holes.contains(h)) return false;
    c->holes.set(h, static_cast<size_t>(i));
    if (c->holes.size() == c->k) emptied.push_back(handle);
    return true;
  }

  // R[b, n] += 1 for each block; the blocks that were at zero are noted for the next hint.
  // Usually all were (a path counted on a node new to it, a request's new pages) or none (a
  // fork's pages its parent counts there), which the size of R tells; otherwise they are the
  // blocks now at one, usually a path's tail (counts do not grow along a path), and holes or
  // anything else take a filter in their order.
  void inc_all(int64_t node, const Hash* hs, size_t n, Run run) {
    HashMap<int64_t>& R = nodes_[node].R;
    size_t added = 0;
    for (size_t i = 0; i < n; ++i) {
      auto [it, fresh] = R.try_emplace(hs[i], 0);
      it.value() += 1;
      added += fresh;
    }
    if (added == n) {
      crossed(node, hs, n, true, run);
      return;
    }
    if (added == 0) return;
    auto at_one = [&](Hash h) {
      auto it = R.find(h);
      return it != R.end() && it->second == 1;
    };
    if (run.ints != nullptr) {
      size_t ones = 0;
      for (size_t i = n - added; i < n; ++i) ones += at_one(hs[i]);
      if (ones == added) {
        crossed(node, hs + (n - added), added, true, Run{run.ints, run.at + n - added});
        return;
      }
    }
    Hashes ones;
    for (size_t i = 0; i < n; ++i)
      if (at_one(hs[i])) ones.push_back(hs[i]);
    crossed(node, ones.data(), ones.size(), true, Run{});
  }

  // Count(β, n, C[β, n] ∩ π_new) where π_new keeps the first `keep` blocks of the path; with
  // `keep` 0, Release(β, n).
  void trim(Branch& b, int64_t handle, int64_t node, size_t keep) {
    Counted* c = b.at(node);
    if (c == nullptr || c->k <= keep) return;
    HashMap<int64_t>& R = nodes_[node].R;
    Hashes zeroed;
    size_t k = std::min(c->k, b.path.size());
    bool holes = !c->holes.empty();
    size_t first = 0;  // path index of the first block that reached zero
    for (size_t i = keep; i < k; ++i) {
      Hash h = b.path[i];
      if (holes && c->holes.contains(h)) continue;
      auto it = R.find(h);
      if (it == R.end()) continue;
      if (it->second == 1) {
        R.erase(it);
        if (zeroed.empty()) first = i;
        zeroed.push_back(h);
      } else {
        it.value() -= 1;
      }
    }
    // Counts do not grow along a path, so the blocks that reach zero are usually the path's
    // blocks from some point on: a run of it.
    Run run = zeroed.size() == k - first ? Run{b.ints.ptr(), first} : Run{};
    if (!zeroed.empty()) crossed(node, zeroed.data(), zeroed.size(), false, run);
    if (holes) c->holes.retain([&](Hash, size_t i) { return i < keep; });
    if (keep) {
      c->k = keep;
    } else {
      b.on.erase(b.on.begin() + (c - b.on.data()));
      nodes_[node].branches.erase(handle);
    }
  }

  // Notes distinct blocks whose count crossed zero (`up`: became positive); `run`: where they
  // sit in a list of ints. A note already there is the opposite crossing since the last hint:
  // the two cancel, so the notes stay bounded by what the last hint got wrong whether or not
  // anyone takes the hints.
  void crossed(int64_t node, const Hash* blocks, size_t n, bool up, Run run) {
    Node& nd = nodes_[node];
    nd.hinted = true;
    if (nd.has_slice) {
      nd.has_slice = false;
      for (Hash h : nd.slice) nd.notes.set(h, nd.slice_up);
      nd.slice.clear();
      nd.slice_ints.reset();
    } else if (nd.notes.empty()) {
      nd.has_slice = true;
      nd.slice_up = up;
      nd.slice.assign(blocks, blocks + n);
      if (run.ints != nullptr && run.at + n <= static_cast<size_t>(PyList_GET_SIZE(run.ints)))
        nd.slice_ints = nb::steal(PyList_GetSlice(run.ints, run.at, run.at + n));
      return;
    }
    bool disjoint = std::none_of(blocks, blocks + n, [&](Hash h) { return nd.notes.contains(h); });
    for (size_t i = 0; i < n; ++i) {
      if (disjoint || !nd.notes.erase(blocks[i])) nd.notes.set(blocks[i], up);
    }
  }

  std::vector<Node> nodes_;
  std::vector<Branch> branches_;  // by handle; dead ones are reused
  std::vector<int64_t> free_;
};

BranchTable& branch_table(nb::handle table) {
  BranchTable* t = nullptr;
  if (table.is_none() || !nb::try_cast<BranchTable*>(table, t)) {
    throw nb::type_error("counts must be a native BranchTable");
  }
  return *t;
}

void evicted(BranchTable& table, int64_t node, const Hashes& blocks) {
  table.evicted(node, blocks);
}

void bind_branches(nb::module_& m) {
  using namespace nb::literals;
  nb::class_<BranchTable>(m, "BranchTable",
                          "The branch table and its counts (Algorithms E.1, E.2): the core of "
                          "evinfra.directory.branches.BranchTable, by branch handle and node "
                          "index.")
      .def(nb::init<>())
      .def("add_node", &BranchTable::add_node, "phase"_a)
      .def("phase", &BranchTable::phase, "node"_a)
      .def("set_phase", &BranchTable::set_phase, "node"_a, "phase"_a)
      .def("add_branch", &BranchTable::add_branch, "path"_a)
      .def("step", &BranchTable::step, "handle"_a, "keep"_a, "path"_a)
      .def("place", &BranchTable::place, "handle"_a, "node"_a)
      .def("settle", &BranchTable::settle, "handle"_a, "node"_a)
      .def("end", &BranchTable::end, "handle"_a)
      .def("release_node", &BranchTable::release_node, "node"_a)
      .def("evicted", &BranchTable::evicted, "node"_a, "blocks"_a)
      .def("take_hints", &BranchTable::take_hints, "node"_a)
      .def("hinted_nodes", &BranchTable::hinted_nodes)
      .def("waiting", &BranchTable::waiting, "node"_a)
      .def("version", &BranchTable::version, "handle"_a)
      .def("nodes_of", &BranchTable::nodes_of, "handle"_a)
      .def("counted", &BranchTable::counted, "handle"_a, "node"_a)
      .def("count", &BranchTable::count, "block"_a, "node"_a)
      .def("counts", &BranchTable::counts, "node"_a)
      .def("branches_on", &BranchTable::branches_on, "node"_a);
}

}  // namespace evinfra
