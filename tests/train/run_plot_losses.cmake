# tierzero-plot-losses (ctest PlotLossesDrawsSeveralRunsAndNamesABadLine):
# two loss.csv files drawn into one PNG; a malformed line is refused naming
# the file and line, and no PNG is written for it.
# Inputs: -DPLOT=<tierzero-plot-losses> -DWORK_DIR=<scratch directory>.
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
file(WRITE "${WORK_DIR}/a.csv" "step,loss,val_loss,seconds,tokens_per_second\n1,5.5,,0.1,100\n2,5.0,4.9,0.1,100\n3,4.5,,0.1,100\n")
file(WRITE "${WORK_DIR}/b.csv" "step,loss,val_loss,seconds,tokens_per_second\n1,5.6,,0.1,100\n2,5.1,5.0,0.1,100\n3,4.4,,0.1,100\n")
file(WRITE "${WORK_DIR}/bad.csv" "step,loss,val_loss,seconds,tokens_per_second\n1,5.6,,0.1,100\n2,oops,,0.1,100\n")
execute_process(COMMAND "${PLOT}" "${WORK_DIR}/both.png" "fp32=${WORK_DIR}/a.csv" "bf16=${WORK_DIR}/b.csv"
                RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "exit ${rc}: ${err}")
endif()
file(READ "${WORK_DIR}/both.png" head LIMIT 8 HEX)
if(NOT head STREQUAL "89504e470d0a1a0a")
  message(FATAL_ERROR "both.png is not a PNG (${head})")
endif()
execute_process(COMMAND "${PLOT}" "${WORK_DIR}/bad.png" "x=${WORK_DIR}/bad.csv" RESULT_VARIABLE rc ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "bad.csv line 3: '2,oops,,0.1,100'" OR EXISTS "${WORK_DIR}/bad.png")
  message(FATAL_ERROR "a malformed line was not refused by name (exit ${rc}): ${err}")
endif()
message("plot losses ok")
