// tierzero/train.h: the train module's public header. A GPT-style decoder
// trained end to end through ZeroEngine on the CPU or on CUDA, its data, and
// its hand-written operators.
//
//   train/ops.h   the operators (matmul, linear, LayerNorm, GELU, attention,
//                 embedding, cross-entropy), forward and backward, float and double
//   train/data.h  the byte-level corpus and the deterministic batch loader
//   train/gpt.h   the model as engine blocks, GptTrainer, forward_backward,
//                 forward_backward_cuda, Reference
//   train/host_memory.h  the trainer's peak host memory, predicted (tierzero-estimate)
#pragma once

#include "tierzero/train/data.h"
#include "tierzero/train/gpt.h"
#include "tierzero/train/host_memory.h"
#include "tierzero/train/ops.h"
