#include "common.h"

namespace evinfra {

void bind_branches(nb::module_&) {}

}  // namespace evinfra
