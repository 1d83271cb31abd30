# estimate(name want pattern ARGS...): runs tierzero-estimate (${ESTIMATE}) with
# ${ESTIMATE_ARGS} and ARGS, writing --json ${WORK_DIR}/<name>.json; fails the
# script unless it exits `want` with stdout+stderr matching `pattern`. Included
# by the run_estimate*.cmake scripts.
function(estimate name want pattern)
  execute_process(COMMAND "${ESTIMATE}" ${ESTIMATE_ARGS} --json "${WORK_DIR}/${name}.json" ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("---- tierzero-estimate ${ESTIMATE_ARGS} ${ARGN} (exit ${rc})\n${out}${err}")
  if(NOT rc EQUAL want)
    message(FATAL_ERROR "${name}: exit ${rc}, expected ${want}")
  endif()
  if(NOT "${out}${err}" MATCHES "${pattern}")
    message(FATAL_ERROR "${name}: the output does not match '${pattern}'")
  endif()
endfunction()
