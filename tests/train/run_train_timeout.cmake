# tierzero-train --collective-timeout: rank 0 of 2 started alone fails its
# rendezvous within the timeout given (2 s, not the 300 s default), naming the
# rank that did not arrive, exits non-zero, and leaves no swap file behind.
# Inputs: -DTRAIN=<tierzero-train> -DWORK_DIR=<scratch directory>.
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}/nvme")
string(TIMESTAMP t0 "%s")
execute_process(COMMAND ${CMAKE_COMMAND} -E env RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2
                        MASTER_ADDR=127.0.0.1 MASTER_PORT=29731 TIERZERO_RENDEZVOUS_DIR=${WORK_DIR}/rdzv
                        "${TRAIN}" --backend host --preset tiny --steps 1 --eval-every 0 --nvme-path "${WORK_DIR}/nvme"
                        --out "${WORK_DIR}/out" --collective-timeout 2
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
string(TIMESTAMP t1 "%s")
math(EXPR took "${t1} - ${t0}")
message("---- tierzero-train alone of 2 ranks (${took} s, rc ${rc})\n${out}${err}")
if(rc EQUAL 0)
  message(FATAL_ERROR "rank 0 alone trained")
endif()
if(NOT err MATCHES "timed out after 2000 ms: rank 0 of 2 on [^ ]+ is still waiting for rank\\(s\\) 1 to arrive")
  message(FATAL_ERROR "the error does not name the timeout given and the missing rank")
endif()
if(took GREATER 20)
  message(FATAL_ERROR "took ${took} s with --collective-timeout 2")
endif()
file(GLOB left "${WORK_DIR}/nvme/*")
if(left)
  message(FATAL_ERROR "left behind: ${left}")
endif()
message("timeout ok")
