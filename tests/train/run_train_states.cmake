# tierzero-train and the compact state formats (ctest TrainStateFormats):
#   1. int8 moments (the config's key) train: six steps, finite losses;
#   2. a remainder master (parameters and optimizer on NVMe; asked for with
#      --master remainder over a config that says fp32) trains exactly the
#      fp32-master run: every step's loss is the same to the CSV's 10
#      significant digits, and the run says its master is a remainder;
#   3. --moments int8 over a config that says fp32 trains int8 moments: its
#      losses differ from the fp32 run's after the first step.
# Inputs: -DTRAIN=<tierzero-train> -DWORK_DIR=<scratch directory>.
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

function(write_config name master moments)
  file(WRITE "${WORK_DIR}/${name}.json" "{
  \"train_micro_batch_size_per_gpu\": 4,
  \"gradient_clipping\": 0.5,
  \"bf16\": { \"enabled\": true },
  \"optimizer\": { \"type\": \"AdamW\", \"params\": { \"lr\": 0.001 } },
  \"zero_optimization\": { \"stage\": 3,
    \"offload_optimizer\": { \"device\": \"nvme\", \"nvme_path\": \"${WORK_DIR}/nvme-${name}\" },
    \"offload_param\": { \"device\": \"nvme\", \"nvme_path\": \"${WORK_DIR}/nvme-${name}\" } },
  \"tierzero\": { \"backend\": \"host\", \"tiers\": { \"gpu_bytes\": \"64MiB\", \"cpu_bytes\": \"256MiB\", \"nvme_bytes\": \"1GiB\" },
                \"states\": { \"master\": \"${master}\", \"moments\": \"${moments}\" } }
}
")
  file(MAKE_DIRECTORY "${WORK_DIR}/nvme-${name}")
endfunction()

function(train name)
  execute_process(COMMAND "${TRAIN}" --config "${WORK_DIR}/${name}.json" --preset tiny --steps 6 --eval-every 0
                          --log-every 1 --out "${WORK_DIR}/out-${name}" ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("---- tierzero-train ${name} (exit ${rc})\n${out}${err}")
  set(rc ${rc} PARENT_SCOPE)
  set(out "${out}" PARENT_SCOPE)
  set(err "${err}" PARENT_SCOPE)
endfunction()

write_config(int8 remainder int8)
train(int8)
if(NOT rc EQUAL 0 OR NOT out MATCHES "step +6/")
  message(FATAL_ERROR "tierzero-train did not train six steps with int8 moments")
endif()

include("${CMAKE_CURRENT_LIST_DIR}/train_losses.cmake")  # read_losses

# The remainder run's config says fp32: --master remainder replaces it.
foreach(master fp32 remainder)
  write_config(${master} fp32 fp32)
  if(master STREQUAL "remainder")
    train(${master} --master remainder)
  else()
    train(${master})
  endif()
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "tierzero-train with a ${master} master exited with ${rc}")
  endif()
  read_losses("${WORK_DIR}/out-${master}/loss.csv" ${master})
endforeach()
foreach(step RANGE 1 6)
  if("${fp32_${step}}" STREQUAL "")
    message(FATAL_ERROR "the fp32 run has no loss for step ${step}")
  endif()
  if(NOT "${fp32_${step}}" STREQUAL "${remainder_${step}}")
    message(FATAL_ERROR "step ${step}: fp32 master loss ${fp32_${step}}, remainder master ${remainder_${step}}")
  endif()
endforeach()
if(NOT out MATCHES "master \\(remainder\\) on nvme")
  message(FATAL_ERROR "the remainder run does not say its master is a remainder")
endif()
message("remainder masters train as fp32 masters: steps 1..6, loss ${fp32_1} .. ${fp32_6}")
# --moments int8 on the command line replaces the config's fp32: a different run.
write_config(flag fp32 fp32)
train(flag --moments int8)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "--moments int8 did not train")
endif()
read_losses("${WORK_DIR}/out-flag/loss.csv" flag)
read_losses("${WORK_DIR}/out-fp32/loss.csv" plain)
if(flag_6 STREQUAL plain_6)
  message(FATAL_ERROR "--moments int8 trained the fp32 run's losses (${flag_6})")
endif()
message("train states ok")
