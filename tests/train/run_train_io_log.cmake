# A training step's NVMe I/O, recorded and replayed (ctest TrainIoLogReplaysThroughTheEngineAndFio):
#   1. tierzero-train --io-log writes the traced step's NVMe requests as a fio
#      version 2 I/O log (the tiny preset with every state on NVMe): reads and
#      writes of the swap file, and the summary reports the NVMe rates achieved
#      and the bytes written per step and per hour (drive wear);
#   2. tierzero-nvme-bench --replay replays it through the engine and through
#      fio, and leaves nothing in its directory.
# Inputs: -DTRAIN=<tierzero-train> -DBENCH=<tierzero-nvme-bench> -DWORK_DIR=<scratch directory>.
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}/replay")

execute_process(COMMAND "${TRAIN}" --backend host --preset tiny --steps 3 --eval-every 0 --nvme-path "${WORK_DIR}/nvme"
                        --out "${WORK_DIR}/out" --io-log "${WORK_DIR}/step.iolog"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("---- tierzero-train --io-log\n${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "tierzero-train --io-log exited with ${rc}")
endif()
if(NOT out MATCHES "NVMe rates achieved +read [0-9.]+ GB/s \\([0-9.]+ s a step with a read in flight\\), write [0-9.]+ GB/s")
  message(FATAL_ERROR "the summary does not report the NVMe rates achieved")
endif()
if(NOT out MATCHES "NVMe write +[0-9.]+ [kMG]?B +\\([0-9.]+ B/param; [0-9.]+ [kMGT]?B per hour of training at [0-9.]+ s a step: drive wear\\)")
  message(FATAL_ERROR "the summary does not report the NVMe bytes written per step and per hour")
endif()
file(STRINGS "${WORK_DIR}/step.iolog" lines)
list(GET lines 0 header)
if(NOT header STREQUAL "fio version 2 iolog")
  message(FATAL_ERROR "step.iolog starts with '${header}'")
endif()
set(reads 0)
set(writes 0)
foreach(line IN LISTS lines)
  if(line MATCHES "tierzero-swap-[^ ]+ read [0-9]+ [0-9]+$")
    math(EXPR reads "${reads} + 1")
  elseif(line MATCHES "tierzero-swap-[^ ]+ write [0-9]+ [0-9]+$")
    math(EXPR writes "${writes} + 1")
  endif()
endforeach()
# 3 blocks (embed, h0, h1): each block's 16-bit shard read in forward and
# backward and the embedding's again for the head; master, exp_avg, exp_avg_sq
# of every block read and written, and the new 16-bit shards written.
if(reads LESS 12 OR writes LESS 12)
  message(FATAL_ERROR "step.iolog holds ${reads} reads and ${writes} writes; expected at least 12 of each")
endif()

execute_process(COMMAND "${BENCH}" --path "${WORK_DIR}/replay" --replay "${WORK_DIR}/step.iolog" --compare-fio
                        --pairs 1 --replay-loops 4 --block-size 64K --queue-depth 8 --json "${WORK_DIR}/replay.json"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("---- tierzero-nvme-bench --replay\n${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "tierzero-nvme-bench --replay exited with ${rc}")
endif()
if(NOT out MATCHES "median +[0-9.]+ +[0-9.]+ +[0-9.]+")
  message(FATAL_ERROR "no ours/fio replay figures (fio is installed by scripts/setup.sh)")
endif()
file(GLOB left "${WORK_DIR}/replay/*")
if(left)
  message(FATAL_ERROR "the replay left files behind: ${left}")
endif()
message("io log ok")
