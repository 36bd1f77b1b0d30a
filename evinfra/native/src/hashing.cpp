#include "common.h"

namespace evinfra {

void bind_hashing(nb::module_&) {}

}  // namespace evinfra
