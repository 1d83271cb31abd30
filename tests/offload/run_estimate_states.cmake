# tierzero-estimate and the state formats, end to end (ctest
# EstimateKnowsTheStateFormatsAndDriveWear): the config's tierzero.states is
# honoured and --master/--moments override it; each format's bytes per element
# reach the report and --json; a remainder master without bf16 is exit 2 naming
# why; --largest finds a model that fits; a drive rating gives the days of
# training until it is reached.
# Inputs: -DESTIMATE=<tierzero-estimate> -DWORK_DIR=<scratch directory>.
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
file(WRITE "${WORK_DIR}/compact.json" [=[{"bf16": {"enabled": true}, "zero_optimization": {"stage": 3},
  "tierzero": {"states": {"master": "remainder", "moments": "int8"}}}]=])

set(ESTIMATE_ARGS --gpu 80GB --cpu 120GB --nvme 2TB)
include("${CMAKE_CURRENT_LIST_DIR}/estimate_run.cmake")

# The master's and the moments' format and bytes per element, from a --json file.
function(expect_states name master master_bytes moments moments_bytes)
  file(READ "${WORK_DIR}/${name}.json" json)
  string(JSON got_master GET "${json}" states 2 format)
  string(JSON got_master_bytes GET "${json}" states 2 bytes_per_elem)
  string(JSON got_moments GET "${json}" states 3 format)
  string(JSON got_moments_bytes GET "${json}" states 3 bytes_per_elem)
  if(NOT got_master STREQUAL master OR NOT got_master_bytes EQUAL master_bytes OR NOT got_moments STREQUAL moments)
    message(FATAL_ERROR "${name}: master ${got_master} ${got_master_bytes} B, moments ${got_moments} "
                        "${got_moments_bytes} B; expected ${master} ${master_bytes}, ${moments} ${moments_bytes}")
  endif()
  if(NOT got_moments_bytes MATCHES "^${moments_bytes}")
    message(FATAL_ERROR "${name}: moments ${got_moments_bytes} B, expected ${moments_bytes}")
  endif()
endfunction()

estimate(default 0 "master fp32 \\(4 B\\), moments fp32 \\(8 B\\)" --params 1B)
expect_states(default fp32 4 fp32 8)
estimate(config 0 "master remainder \\(2.125 B\\), moments int8 \\(2.03125 B\\)" --params 1B
         --config "${WORK_DIR}/compact.json")
expect_states(config remainder 2.125 int8 2.03125)
estimate(flags 0 "master       remainder +2.125" --params 1B --master remainder --moments bf16)
expect_states(flags remainder 2.125 bf16 4)
estimate(override 0 "moments      fp32 +8" --params 1B --config "${WORK_DIR}/compact.json" --moments fp32)
expect_states(override remainder 2.125 fp32 8)
estimate(per_param 0 "per parameter per step: NVMe [0-9.]+ B \\(read [0-9.]+ \\+ write [0-9.]+\\), PCIe [0-9.]+ B"
         --params 1B)

# A remainder master needs bf16 parameters, whichever way the precision is set.
estimate(fp16 2 "\"remainder\" needs bf16 parameters, but fp16.enabled is true" --params 1B --master remainder
         --precision fp16)
estimate(fp32 2 "no 16-bit parameter to build the master on" --params 1B --config "${WORK_DIR}/compact.json"
         --precision fp32)
estimate(bad_name 2 "int4" --params 1B --moments int4)

# The largest model of the default family, 32 equal blocks.
estimate(largest 0 "largest +[0-9.]+B params \\([0-9]+\\) fit, in 32 equal blocks \\(--layers\\); [0-9.]+B \\([0-9]+\\) finds no placement"
         --largest --master remainder --moments int8)
file(READ "${WORK_DIR}/largest.json" json)
string(JSON largest GET "${json}" largest params)
string(JSON planned GET "${json}" inputs params)
if(NOT largest EQUAL planned)
  message(FATAL_ERROR "--largest found ${largest} params but planned ${planned}")
endif()
estimate(largest_and_params 2 "excludes" --largest --params 1B)
# data_types.grad_accum_dtype (Note [16-bit gradient accumulators]): from the
# config or --grad-accum-dtype, 2 B a parameter; a dtype other than the
# training one is exit 2 naming the key.
file(WRITE "${WORK_DIR}/grad16.json" [=[{"bf16": {"enabled": true}, "zero_optimization": {"stage": 3},
  "data_types": {"grad_accum_dtype": "bf16"}}]=])
function(expect_grads name format bytes)
  file(READ "${WORK_DIR}/${name}.json" json)
  string(JSON got GET "${json}" states 1 format)
  string(JSON got_bytes GET "${json}" states 1 bytes_per_elem)
  string(JSON input GET "${json}" inputs grad_accum_dtype)
  if(NOT got STREQUAL format OR NOT got_bytes EQUAL bytes OR NOT input STREQUAL format)
    message(FATAL_ERROR "${name}: grads ${got} ${got_bytes} B (inputs ${input}); expected ${format} ${bytes}")
  endif()
endfunction()
estimate(grads_config 0 "grad +bf16 +2 " --params 1B --config "${WORK_DIR}/grad16.json")
expect_grads(grads_config bf16 2)
estimate(grads_flag 0 "bf16 grads \\(data_types.grad_accum_dtype\\)" --params 1B --grad-accum-dtype bf16
         --offload-optimizer cpu --offload-param none)
expect_grads(grads_flag bf16 2)
estimate(grads_default 0 "grad +fp32 +4 " --params 1B)
expect_grads(grads_default fp32 4)
estimate(grads_fp16 2 "data_types.grad_accum_dtype: \"bf16\" with fp16 training is not supported" --params 1B
         --config "${WORK_DIR}/grad16.json" --precision fp16)

estimate(neither 2 "--params is required" --master fp32)

# Drive wear: 10B params hold 160 GB of grads and optimizer states, more than the 120 GB of CPU:
# some go to NVMe, written every step.
estimate(wear 0 "days of training until the rating is reached: [0-9.]+" --params 10B --tbw 1200)
estimate(wear_dwpd 0 "1 DWPD x 2.00 TB x 365 days x 5 years = 3650 TBW" --params 10B --dwpd 1
         --drive-capacity 2TB)
estimate(wear_measured 0 "step time +36.50 s: --step-seconds \\(measured\\)" --params 10B --tbw 1200
         --step-seconds 36.5)
file(READ "${WORK_DIR}/wear_measured.json" json)
string(JSON written GET "${json}" drive_wear written_per_step_bytes)
string(JSON per_hour GET "${json}" drive_wear written_per_hour_bytes)
string(JSON days GET "${json}" drive_wear days_to_rating)
string(JSON nvme_write GET "${json}" traffic nvme_write_bytes)
if(NOT written EQUAL nvme_write)
  message(FATAL_ERROR "one rank writes ${nvme_write} B a step, the drive wear counts ${written}")
endif()
math(EXPR hourly "${written} * 3600 * 10 / 365" OUTPUT_FORMAT DECIMAL)  # 3600 / 36.5 s, rounded down
math(EXPR hourly_high "${hourly} + 1" OUTPUT_FORMAT DECIMAL)
if(per_hour LESS hourly OR per_hour GREATER hourly_high)
  message(FATAL_ERROR "written per hour ${per_hour}, expected about ${hourly}")
endif()
estimate(wear_needs_capacity 2 "drive-capacity" --params 8B --dwpd 1)
estimate(no_rating 0 "give the drive's rating" --params 10B)
message("estimate states ok")
