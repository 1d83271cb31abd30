// tierzero/comm.h: the comm module's public header — ranks and collectives.
//
//   comm/communicator.h     Communicator: collectives over ranks (Gloo on CPU, NCCL on GPU),
//                           the rank variables of torchrun and mpirun, the rendezvous
//   comm/agreement.h        RankAgreement: checks every rank must pass alike, broadcasts
//   comm/store.h            RendezvousStore: a network key-value store ranks meet through
//   comm/host_collectives.h collectives on small host arrays whatever memory the communicator takes
#pragma once

#include "tierzero/comm/agreement.h"
#include "tierzero/comm/communicator.h"
#include "tierzero/comm/host_collectives.h"
#include "tierzero/comm/store.h"
