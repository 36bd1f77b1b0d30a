#include "common.h"

namespace evinfra {

void bind_tree(nb::module_&) {}

}  // namespace evinfra
