#include "common.h"

namespace evinfra {

void bind_host_order(nb::module_&) {}

}  // namespace evinfra
