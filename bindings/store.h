// A tz::RendezvousStore over a Python key-value store with torch.distributed's
// Store methods (set, get, wait, add, delete_key): how Python ranks on
// different machines meet through torch's c10d store (Note [Store
// rendezvous] in comm/src/store_rendezvous.cpp).
//
// Note [Python store and the GIL]
// The communicator is created inside Engine() with the GIL released
// (Note [Engine calls and the GIL]); each store call takes the GIL for its
// length and lets it go, so other Python threads run while a rank waits for
// the others. The engine's mutex is held meanwhile, which breaks the rule
// that a thread holding it never takes the GIL; that is safe here because
// the core is still being constructed, so no other thread can know it, let
// alone wait for its mutex. Waits go to the store's wait() with what is left
// of the timeout, so the GIL is never held longer than one wait.
#pragma once

#include <nanobind/nanobind.h>

#include <memory>
#include <string>

#include "tierzero/comm.h"

namespace tzpy {

namespace nb = nanobind;

// `store`: the Python store; `name`: how errors and the log name it
// ("torch TCPStore at 10.0.0.1:29500"). Call with the GIL held.
std::shared_ptr<tz::RendezvousStore> make_python_store(nb::object store, std::string name);

}  // namespace tzpy
