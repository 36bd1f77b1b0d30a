// Types every part of the native core shares.
#pragma once

#include <cstdint>
#include <vector>

#include <nanobind/nanobind.h>
#include <tsl/robin_map.h>

namespace evinfra {

namespace nb = nanobind;

// A block: SGLang's page-chained hash, a signed int64 (core/hashing.py).
using Hash = int64_t;
using Hashes = std::vector<Hash>;

// nanobind ships tsl::robin_map (not robin_set): a set of blocks is a HashMap<Unit>.
template <class V>
using HashMap = tsl::robin_map<Hash, V>;
struct Unit {};

void bind_hashing(nb::module_& m);
void bind_tree(nb::module_& m);
void bind_branches(nb::module_& m);
void bind_host_order(nb::module_& m);
void bind_cache(nb::module_& m);

}  // namespace evinfra
