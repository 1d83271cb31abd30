# The faults of issue #23 caused through the programs themselves (ctest
# TrainFaultsAreRefusedByNameAndLeaveNothing, label `fault`; docs/faults.md):
# each must end in an error that names the cause (never an abort, rc 134, or
# a hang), and leave nothing in the NVMe folder or the rendezvous directory.
#   - a config number beyond a double, a key given twice (tierzero-train and
#     tierzero-estimate);
#   - --data naming a folder, or /dev/urandom;
#   - activations that cannot fit (a huge --batch x --seq);
#   - a trace that cannot be written (the errno named);
#   - a checkpoint whose rank manifest was edited (step 2 -> 90);
#   - two ranks whose configs differ in lr, precision, or accumulation steps
#     (both refused at once, naming the setting; it used to train silently,
#     abort in Gloo, or wait out the 300 s timeout).
# Inputs: -DTRAIN=<tierzero-train> -DESTIMATE=<tierzero-estimate>
#         -DCONFIG=<examples/train_cpu_nvme.json> -DWORK_DIR=<scratch directory>.
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
file(READ "${CONFIG}" base)

# A copy of the shipped config with `from` replaced by `to`.
function(config_with name from to)
  string(FIND "${base}" "${from}" at)
  if(at LESS 0)
    message(FATAL_ERROR "${CONFIG} has no '${from}' to replace")
  endif()
  string(REPLACE "${from}" "${to}" text "${base}")
  file(WRITE "${WORK_DIR}/${name}.json" "${text}")
endfunction()

config_with(overflow "\"lr\": 3e-4" "\"lr\": 1e400")
config_with(twice "\"gradient_clipping\": 1.0," "\"gradient_clipping\": 1.0, \"gradient_clipping\": 0.5,")
config_with(lr "\"lr\": 3e-4" "\"lr\": 1e-3")
config_with(fp16 "\"bf16\": { \"enabled\": true }" "\"fp16\": { \"enabled\": true }")
config_with(gas "\"gradient_accumulation_steps\": 1" "\"gradient_accumulation_steps\": 2")

# Fails unless `folder` holds no file (folders may stay).
function(expect_nothing_in folder what)
  file(GLOB_RECURSE left "${folder}/*")
  if(left)
    message(FATAL_ERROR "${what}: left behind: ${left}")
  endif()
endfunction()

# Runs `program ARGN`; it must exit with `rc` (a number: never killed by a
# signal) and print `pattern` on stderr; its NVMe folder must be empty after.
function(expect_refusal name rc pattern program)
  file(MAKE_DIRECTORY "${WORK_DIR}/nvme-${name}")
  execute_process(COMMAND "${program}" ${ARGN} RESULT_VARIABLE got OUTPUT_VARIABLE out ERROR_VARIABLE err
                  TIMEOUT 120)
  message("---- ${name}: rc ${got}\n${err}")
  if(NOT got STREQUAL "${rc}")
    message(FATAL_ERROR "${name}: exit ${got}, not ${rc}:\n${out}${err}")
  endif()
  if(NOT err MATCHES "${pattern}")
    message(FATAL_ERROR "${name}: the error does not say '${pattern}':\n${err}")
  endif()
  expect_nothing_in("${WORK_DIR}/nvme-${name}" "${name}")
endfunction()

# tierzero-train's tiny run; ARGN adds to it.
function(train_refusal name rc pattern)
  expect_refusal(${name} ${rc} "${pattern}" "${TRAIN}" --backend host --preset tiny --steps 3 --eval-every 0
                 --nvme-path "${WORK_DIR}/nvme-${name}" --out "${WORK_DIR}/out-${name}" ${ARGN})
endfunction()

train_refusal(overflow 2 "overflow.json: optimizer.params.lr: number overflow" --config "${WORK_DIR}/overflow.json")
expect_refusal(estimate_overflow 2 "overflow.json: optimizer.params.lr: number overflow" "${ESTIMATE}"
               --config "${WORK_DIR}/overflow.json" --params 1B)
train_refusal(twice 2 "gradient_clipping is given twice" --config "${WORK_DIR}/twice.json")
train_refusal(folder 2 "corpus ${WORK_DIR}: is a folder" --config "${CONFIG}" --data "${WORK_DIR}")
train_refusal(urandom 2 "/dev/urandom: is not a regular file" --config "${CONFIG}" --data /dev/urandom)
train_refusal(activations 1 "activations of 4096 x 4096 tokens .* need .* lower --batch or --seq" --config "${CONFIG}"
              --batch 4096 --seq 4096)
train_refusal(trace 1 "writing the trace.*${WORK_DIR}/no-such-folder/trace.json.*No such file or directory"
              --config "${CONFIG}" --trace "${WORK_DIR}/no-such-folder/trace.json")

# A checkpoint whose rank manifest says another step: refused, naming the file.
execute_process(COMMAND "${TRAIN}" --backend host --preset tiny --steps 2 --eval-every 0 --config "${CONFIG}"
                        --nvme-path "${WORK_DIR}/nvme-save" --out "${WORK_DIR}/out-save" --save "${WORK_DIR}/ckpt"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "saving a checkpoint: ${rc}\n${out}${err}")
endif()
file(READ "${WORK_DIR}/ckpt/step-2/rank-0.json" manifest)
string(REPLACE "\"step\": 2" "\"step\": 90" edited "${manifest}")
if(edited STREQUAL manifest)
  message(FATAL_ERROR "rank-0.json has no '\"step\": 2':\n${manifest}")
endif()
file(WRITE "${WORK_DIR}/ckpt/step-2/rank-0.json" "${edited}")
train_refusal(edited 1 "checksum mismatch in ${WORK_DIR}/ckpt/step-2/rank-0.json" --config "${CONFIG}"
              --resume "${WORK_DIR}/ckpt")

# Two ranks whose configs differ in one setting: both refused at creation,
# naming it, in well under the --collective-timeout.
set(port 29761)
function(two_ranks name other pattern)
  math(EXPR port "${port} + 1")
  set(port ${port} PARENT_SCOPE)
  set(common --backend host --preset tiny --steps 2 --eval-every 0 --collective-timeout 60)
  set(env MASTER_ADDR=127.0.0.1 MASTER_PORT=${port} WORLD_SIZE=2 LOCAL_WORLD_SIZE=2
          TIERZERO_RENDEZVOUS_DIR=${WORK_DIR}/rdzv-${name})
  string(TIMESTAMP t0 "%s")
  # Two COMMANDs run at once (a pipeline): the two ranks.
  execute_process(
    COMMAND ${CMAKE_COMMAND} -E env ${env} RANK=0 LOCAL_RANK=0 "${TRAIN}" ${common} --config "${CONFIG}"
            --nvme-path "${WORK_DIR}/nvme-${name}0" --out "${WORK_DIR}/out-${name}0"
    COMMAND ${CMAKE_COMMAND} -E env ${env} RANK=1 LOCAL_RANK=1 "${TRAIN}" ${common} --config "${other}"
            --nvme-path "${WORK_DIR}/nvme-${name}1" --out "${WORK_DIR}/out-${name}1"
    RESULTS_VARIABLE codes OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
  string(TIMESTAMP t1 "%s")
  math(EXPR took "${t1} - ${t0}")
  message("---- two ranks, ${name}: rc ${codes} in ${took} s\n${err}")
  if(NOT codes STREQUAL "2;2")
    message(FATAL_ERROR "two ranks, ${name}: exits ${codes}, not 2;2 (a refusal on both)")
  endif()
  string(REGEX MATCHALL "the ranks' settings differ, first at ${pattern}" named "${err}")
  list(LENGTH named times)
  if(NOT times EQUAL 2)
    message(FATAL_ERROR "two ranks, ${name}: not both name ${pattern}:\n${err}")
  endif()
  if(took GREATER 40)
    message(FATAL_ERROR "two ranks, ${name}: took ${took} s")
  endif()
  expect_nothing_in("${WORK_DIR}/nvme-${name}0" "${name} rank 0")
  expect_nothing_in("${WORK_DIR}/nvme-${name}1" "${name} rank 1")
  expect_nothing_in("${WORK_DIR}/rdzv-${name}" "${name}'s rendezvous directory")
endfunction()
two_ranks(lr "${WORK_DIR}/lr.json" "optimizer.params.lr")
two_ranks(precision "${WORK_DIR}/fp16.json" "precision")
two_ranks(accumulation "${WORK_DIR}/gas.json" "gradient_accumulation_steps")
message("train faults ok")
