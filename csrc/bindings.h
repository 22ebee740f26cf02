// The parts of nsa_cp._C's module definition (bindings.cpp) that live in files of their own.
#pragma once

#include <pybind11/pybind11.h>

namespace nsa_cp {

void bind_p2p_state(pybind11::module_& m);  // bindings_p2p_state.cpp

}  // namespace nsa_cp
