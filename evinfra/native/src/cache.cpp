#include "common.h"

namespace evinfra {

void bind_cache(nb::module_&) {}

}  // namespace evinfra
