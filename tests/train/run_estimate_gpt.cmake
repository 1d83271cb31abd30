# tierzero-estimate for tierzero-train's GPT, end to end (ctest
# EstimatePredictsTheTrainersHostMemory): --hidden with --layers, --heads and
# --seq plans the GPT's blocks and prints the trainer's host memory on the CPU
# backend (Note [Peak RSS estimate]); the parts add up to the predicted peak,
# states and buffers are the plan's device and CPU tiers, the activations grow
# with --batch and --seq, evaluation's buffers go with --eval-batches 0, the
# corpus is the file's size; a shape the trainer
# would refuse, or a GPT mixed with --params, is exit 2 naming why.
# Inputs: -DESTIMATE=<tierzero-estimate> -DCONFIG=<examples/train_cpu_nvme.json>
#         -DCORPUS=<data/kjv.txt> -DWORK_DIR=<scratch directory>.
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
set(ESTIMATE_ARGS --config "${CONFIG}" --nvme 8GB)
include("${CMAKE_CURRENT_LIST_DIR}/../offload/estimate_run.cmake")
set(demo --layers 6 --hidden 384 --heads 6 --seq 128)

function(host_memory name out_var)
  file(READ "${WORK_DIR}/${name}.json" json)
  foreach(key state_bytes buffer_bytes activation_bytes evaluation_bytes corpus_bytes runtime_bytes
              predicted_peak_rss_bytes)
    string(JSON v GET "${json}" host_memory ${key})
    set(${out_var}_${key} ${v} PARENT_SCOPE)
  endforeach()
  string(JSON gpu GET "${json}" tiers 0 per_rank_bytes)
  string(JSON cpu GET "${json}" tiers 1 per_rank_bytes)
  math(EXPR tiers "${gpu} + ${cpu}")
  set(${out_var}_tiers ${tiers} PARENT_SCOPE)
endfunction()

estimate(demo 0 "predicted peak RSS" ${demo})
host_memory(demo d)
math(EXPR sum "${d_state_bytes} + ${d_buffer_bytes} + ${d_activation_bytes} + ${d_evaluation_bytes} + ${d_corpus_bytes} + ${d_runtime_bytes}")
if(NOT sum EQUAL d_predicted_peak_rss_bytes)
  message(FATAL_ERROR "the parts add to ${sum}, the prediction is ${d_predicted_peak_rss_bytes}")
endif()
math(EXPR planned "${d_state_bytes} + ${d_buffer_bytes}")
if(NOT planned EQUAL d_tiers)
  message(FATAL_ERROR "states + buffers = ${planned}, the plan's device and CPU tiers hold ${d_tiers}")
endif()
file(SIZE "${CORPUS}" corpus_size)
if(NOT d_corpus_bytes EQUAL corpus_size)
  message(FATAL_ERROR "corpus ${d_corpus_bytes} bytes, ${CORPUS} has ${corpus_size}")
endif()

# The config's micro batch is 4: --batch 8 doubles every per-token buffer.
estimate(batch8 0 "8 x 128 tokens through 6 layers x 384" ${demo} --batch 8)
host_memory(batch8 b)
if(NOT b_activation_bytes GREATER d_activation_bytes OR NOT b_state_bytes EQUAL d_state_bytes)
  message(FATAL_ERROR "--batch 8: activations ${b_activation_bytes} (batch 4: ${d_activation_bytes}), "
                      "states ${b_state_bytes} (${d_state_bytes})")
endif()
estimate(seq256 0 "4 x 256 tokens" --layers 6 --hidden 384 --heads 6 --seq 256)
host_memory(seq256 s)
if(NOT s_activation_bytes GREATER d_activation_bytes)
  message(FATAL_ERROR "--seq 256: activations ${s_activation_bytes}, not more than ${d_activation_bytes}")
endif()

# tierzero-train evaluates 4 batches by default; a run with --eval-every 0 holds no evaluation buffers.
if(NOT d_evaluation_bytes GREATER 0)
  message(FATAL_ERROR "the default run evaluates, but its evaluation buffers are ${d_evaluation_bytes} bytes")
endif()
estimate(no_eval 0 "evaluation +0.0 MiB  0 batches" ${demo} --eval-batches 0)
host_memory(no_eval n)
math(EXPR without "${d_predicted_peak_rss_bytes} - ${d_evaluation_bytes}")
if(NOT n_evaluation_bytes EQUAL 0 OR NOT n_predicted_peak_rss_bytes EQUAL without)
  message(FATAL_ERROR "--eval-batches 0: evaluation ${n_evaluation_bytes}, predicted ${n_predicted_peak_rss_bytes} "
                      "(expected ${without})")
endif()

estimate(no_heads 2 "--hidden requires --heads" --layers 6 --hidden 384 --seq 128)
estimate(indivisible 2 "hidden = 384 is not divisible by heads = 5" --layers 6 --hidden 384 --heads 5 --seq 128)
estimate(with_params 2 "--params excludes --hidden" ${demo} --params 1B)
estimate(no_data 2 "--data: File does not exist" ${demo} --data "${WORK_DIR}/missing.txt")
message("estimate gpt ok")
