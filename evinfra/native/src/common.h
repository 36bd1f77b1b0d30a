// Types every part of the native core shares.
#pragma once

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <limits>
#include <new>
#include <vector>

#include <nanobind/nanobind.h>
#include <tsl/robin_map.h>

namespace evinfra {

namespace nb = nanobind;

// A block: SGLang's page-chained hash, a signed int64 (core/hashing.py).
using Hash = int64_t;
using Hashes = std::vector<Hash>;

// A block hash from a plain int (True), read from CPython's digits: PyLong_AsLongLong takes a
// general path for ints of more than one digit, as most hashes are, at 2-3x the cost.
// False for anything else (an int subclass, an int too large: any_hash() then decides).
inline bool exact_hash(PyObject* o, Hash& out) {
#if PY_VERSION_HEX < 0x030C0000 && !defined(Py_LIMITED_API) && PyLong_SHIFT == 30
  if (!PyLong_CheckExact(o)) return false;
  const Py_ssize_t size = Py_SIZE(o);
  const digit* d = reinterpret_cast<PyLongObject*>(o)->ob_digit;
  uint64_t magnitude;
  switch (size < 0 ? -size : size) {
    case 0:
      magnitude = 0;
      break;
    case 1:
      magnitude = d[0];
      break;
    case 2:
      magnitude = d[0] | uint64_t{d[1]} << 30;
      break;
    case 3:
      if (d[2] >= 8) return false;  // 2**63 or more: only -2**63 fits, any_hash() sees to it
      magnitude = d[0] | uint64_t{d[1]} << 30 | uint64_t{d[2]} << 60;
      break;
    default:
      return false;
  }
  out = static_cast<Hash>(size < 0 ? uint64_t{0} - magnitude : magnitude);
  return true;
#else
  (void)o;
  (void)out;
  return false;
#endif
}

// A block hash from any object with __index__ (Python code may run); TypeError otherwise or
// when it does not fit in a signed 64-bit int.
inline Hash any_hash(nb::handle o) {
  nb::object i = nb::steal(PyNumber_Index(o.ptr()));
  if (!i.is_valid()) throw nb::python_error();
  int overflow;
  const long long v = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
  if (v == -1 && PyErr_Occurred()) throw nb::python_error();
  if (overflow) throw nb::type_error("a block hash is a signed 64-bit int");
  return v;
}

// Large tables on transparent huge pages. The block maps and slot records of a simulated
// cluster span hundreds of MB and are probed at random, so with 4 KiB pages most probes miss
// the TLB as well as the cache (bench.sim: 5-10 % of its CPU time). Where THP is "madvise"
// (Debian's default) nothing gets huge pages unless asked; the advice changes no result, and
// a kernel that refuses it leaves 4 KiB pages.
template <class T>
struct HugeAlloc {
  using value_type = T;
  static constexpr size_t kHuge = size_t{2} << 20;  // x86-64's huge page
  HugeAlloc() noexcept = default;
  template <class U>
  HugeAlloc(const HugeAlloc<U>&) noexcept {}
  T* allocate(size_t n) {
    if (n > (std::numeric_limits<size_t>::max() - kHuge) / sizeof(T)) {
      throw std::bad_array_new_length();
    }
    const size_t bytes = n * sizeof(T);
    if (bytes < kHuge) return static_cast<T*>(::operator new(bytes));
    const size_t size = (bytes + kHuge - 1) & ~(kHuge - 1);
    void* p = std::aligned_alloc(kHuge, size);
    if (p == nullptr) throw std::bad_alloc();
    madvise(p, size, MADV_HUGEPAGE);
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t n) noexcept {
    if (n * sizeof(T) < kHuge) {
      ::operator delete(p);
    } else {
      std::free(p);
    }
  }
  template <class U>
  bool operator==(const HugeAlloc<U>&) const noexcept { return true; }
  template <class U>
  bool operator!=(const HugeAlloc<U>&) const noexcept { return false; }
};
template <class T>
using BigVector = std::vector<T, HugeAlloc<T>>;

// nanobind ships tsl::robin_map (not robin_set): a set of blocks is a HashMap<Unit>.
template <class V>
using HashMap = tsl::robin_map<Hash, V, std::hash<Hash>, std::equal_to<Hash>,
                               HugeAlloc<std::pair<Hash, V>>>;
struct Unit {};

// The directory's branch table (branches.cpp): the tree hands it the blocks a node lost in a
// batch (E.2 line 20) natively.
class BranchTable;
// The native table behind a Python object (TypeError if it is not one).
BranchTable& branch_table(nb::handle table);
// E.2 line 20: `node` lost `blocks`; zero their counts there.
void evicted(BranchTable& table, int64_t node, const Hashes& blocks);

void bind_hashing(nb::module_& m);
void bind_tree(nb::module_& m);
void bind_branches(nb::module_& m);
void bind_host_order(nb::module_& m);
void bind_cache(nb::module_& m);

}  // namespace evinfra
