// The extension module evinfra.native._native: one bind function per part.
#include "common.h"

NB_MODULE(_native, m) {
  m.doc() = "evinfra's native core (issue 37): see evinfra/native/README.md";
  // Objects still alive when the interpreter exits (a directory in a reference cycle, a
  // module-level cache) are not leaks of ours; nanobind would list each one on stderr.
  nanobind::set_leak_warnings(false);
  evinfra::bind_hashing(m);
  evinfra::bind_tree(m);
  evinfra::bind_branches(m);
  evinfra::bind_host_order(m);
  evinfra::bind_cache(m);
}
