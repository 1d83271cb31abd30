# tierzero-train's learning-rate warm-up (ctest TrainWarmsUpByDefaultAndWarnsWhenTheLossRises):
#   1. with no --warmup-steps it prints the default warm-up, sized for the model
#      (Note [Default warm-up]: ceil(0.5 x 2 x 64^2 / 100) = 41 steps here) and
#      the first step runs at lr / 41;
#   2. at a learning rate far too high for the model and no warm-up
#      (--warmup-steps 0) the loss rises past 1.25x the first step's and the
#      trainer warns once, naming the warm-up and the learning rate;
#   3. the same run warmed up slowly enough does not warn;
#   4. a run resumed from a checkpoint keeps the warm-up the checkpoint's run
#      had (its client state records it), not this run's default.
# Inputs: -DTRAIN=<tierzero-train> -DWORK_DIR=<scratch directory>.
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
file(WRITE "${WORK_DIR}/hot.json" [=[{
  "train_micro_batch_size_per_gpu": 4,
  "gradient_clipping": 1.0,
  "bf16": { "enabled": true },
  "optimizer": { "type": "AdamW", "params": { "lr": 0.5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1 } },
  "zero_optimization": { "stage": 3, "offload_param": { "device": "cpu" }, "offload_optimizer": { "device": "cpu" } },
  "tierzero": { "backend": "host", "tiers": { "gpu_bytes": "64MiB", "cpu_bytes": "256MiB", "nvme_bytes": 0 } }
}
]=])

function(train name)
  execute_process(COMMAND "${TRAIN}" --config "${WORK_DIR}/hot.json" --preset tiny --steps 8 --eval-every 0
                          --log-every 1 --out "${WORK_DIR}/${name}" ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("---- tierzero-train ${ARGN}\n${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "tierzero-train ${ARGN} exited with ${rc}:\n${err}")
  endif()
  set(last_output "${out}" PARENT_SCOPE)
  set(last_error "${err}" PARENT_SCOPE)
endfunction()

train(default)
if(NOT last_output MATCHES "learning rate: 0.5, warmed up linearly over 41 steps, the default for 2 layers x 64 hidden")
  message(FATAL_ERROR "the default warm-up was not 41 steps, or was not said")
endif()
if(NOT last_output MATCHES "step +1/8 [^\n]*lr 0.0122 ")
  message(FATAL_ERROR "the first step did not run at lr 0.5 / 41")
endif()

train(none --warmup-steps 0)
if(NOT last_output MATCHES "learning rate: 0.5 from the first step \\(--warmup-steps 0\\)")
  message(FATAL_ERROR "--warmup-steps 0 was not said")
endif()
if(NOT last_error MATCHES "warning: the loss rose from [0-9.]+ \\(step 1\\) to [0-9.]+ \\(step [0-9]\\), more than 1.25x")
  message(FATAL_ERROR "no warning about the rising loss")
endif()
string(REGEX MATCHALL "the loss rose" warnings "${last_error}")
list(LENGTH warnings count)
if(NOT count EQUAL 1)
  message(FATAL_ERROR "warned ${count} times, not once")
endif()
if(NOT last_error MATCHES "--warmup-steps, now 0")
  message(FATAL_ERROR "the warning does not name the warm-up")
endif()

train(slow --warmup-steps 100000)
if(last_error MATCHES "the loss rose")
  message(FATAL_ERROR "warned although the learning rate stayed tiny")
endif()

train(saved --warmup-steps 7 --save "${WORK_DIR}/ckpt")
execute_process(COMMAND "${TRAIN}" --config "${WORK_DIR}/hot.json" --preset tiny --steps 2 --eval-every 0 --log-every 1
                        --out "${WORK_DIR}/resumed" --resume "${WORK_DIR}/ckpt"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("---- tierzero-train --resume\n${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the resumed run exited with ${rc}")
endif()
if(NOT out MATCHES "warmed up linearly over 7 steps \\(as the resumed run was\\)")
  message(FATAL_ERROR "the resumed run did not keep the saved warm-up of 7 steps")
endif()
if(NOT out MATCHES "step +9/10 [^\n]*lr 0.5 ")  # past the warm-up of 7: the config's rate
  message(FATAL_ERROR "the resumed run's step 9 did not run at the config's lr")
endif()
message("warm-up ok")
