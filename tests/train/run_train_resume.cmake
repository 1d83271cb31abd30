# tierzero-train end to end (ctest TrainResumeContinuesTheUnbrokenRun):
#   1. an unbroken run of 16 steps of the tiny preset, states on NVMe;
#   2. 8 steps saving a checkpoint, then 8 more resumed from it in a new process.
# The resumed run must print the loss of every step 9..16 exactly as the
# unbroken run did (the loss CSV has 10 significant digits; resuming is
# bit for bit), and the unbroken run's loss must fall.
# Inputs: -DTRAIN=<tierzero-train> -DWORK_DIR=<scratch directory>.
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

# --backend host: the comparison is exact, and the CUDA GPT's embedding
# backward sums with atomics (not bit-reproducible run to run).
function(train name)
  execute_process(COMMAND "${TRAIN}" --backend host --preset tiny --eval-every 0 --log-every 4 --nvme-path "${WORK_DIR}/nvme-${name}"
                          --out "${WORK_DIR}/${name}" ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("---- tierzero-train ${ARGN}\n${out}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "tierzero-train ${ARGN} exited with ${rc}:\n${err}")
  endif()
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

include("${CMAKE_CURRENT_LIST_DIR}/train_losses.cmake")  # read_losses

train(full --steps 16)
if(NOT last_output MATCHES "the loss fell")
  message(FATAL_ERROR "the unbroken run's loss did not fall")
endif()
# A restart loop's first run: --resume-if-present on a folder with nothing yet
# starts fresh; --keep-last 2 leaves the two newest of its four checkpoints.
train(first --steps 8 --resume "${WORK_DIR}/ckpt" --resume-if-present --save "${WORK_DIR}/ckpt" --save-every 2
      --keep-last 2)
if(NOT last_output MATCHES "no checkpoint there yet, starting fresh")
  message(FATAL_ERROR "--resume-if-present did not start fresh on an empty folder")
endif()
file(GLOB kept RELATIVE "${WORK_DIR}/ckpt" "${WORK_DIR}/ckpt/*")
list(SORT kept)
if(NOT kept STREQUAL ".tierzero-save.lock;latest;step-6;step-8")
  message(FATAL_ERROR "--keep-last 2 left: ${kept}")
endif()
train(resumed --steps 8 --resume "${WORK_DIR}/ckpt" --resume-if-present)
if(NOT last_output MATCHES "resumed from .* at step 8")
  message(FATAL_ERROR "the resumed run did not start at step 8")
endif()

read_losses("${WORK_DIR}/full/loss.csv" full)
read_losses("${WORK_DIR}/resumed/loss.csv" resumed)
# A broken latest is not "nothing yet": refused even with --resume-if-present.
file(WRITE "${WORK_DIR}/broken/latest" "step-99")
execute_process(COMMAND "${TRAIN}" --backend host --preset tiny --steps 1 --nvme-path "${WORK_DIR}/nvme-broken"
                        --out "${WORK_DIR}/broken-out" --resume "${WORK_DIR}/broken" --resume-if-present
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "broken/latest names 'step-99', which is not a complete checkpoint")
  message(FATAL_ERROR "a broken checkpoint folder was taken for an empty one (rc ${rc}):\n${out}${err}")
endif()
foreach(step RANGE 9 16)
  if(NOT DEFINED resumed_${step})
    message(FATAL_ERROR "the resumed run has no loss for step ${step}")
  endif()
  if(NOT "${full_${step}}" STREQUAL "${resumed_${step}}")
    message(FATAL_ERROR "step ${step}: unbroken run loss ${full_${step}}, resumed run ${resumed_${step}}")
  endif()
endforeach()
message("resumed run matches the unbroken run: steps 9..16, loss ${full_9} .. ${full_16}")
