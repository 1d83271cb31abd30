# tierzero-estimate end to end (ctest EstimateFollowsTheTrainingPrecision):
# without a config the estimate is for 16-bit params; a config without bf16 or
# fp16 trains fp32 params, planned at 4 B; --precision overrides either; a bad
# --precision is exit 2, an fp32 model that does not fit is exit 1 naming bf16.
# Inputs: -DESTIMATE=<tierzero-estimate> -DWORK_DIR=<scratch directory>.
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
file(WRITE "${WORK_DIR}/fp32.json" [=[{"zero_optimization": {"stage": 3}}]=])

set(ESTIMATE_ARGS --params 1B --cpu 120GB --nvme 2TB)
include("${CMAKE_CURRENT_LIST_DIR}/estimate_run.cmake")

# param_bytes and the param16 state's bytes per rank, from a --json file.
function(read_params name)
  file(READ "${WORK_DIR}/${name}.json" json)
  string(JSON bytes GET "${json}" inputs param_bytes)
  string(JSON per_rank GET "${json}" states 0 bytes_per_rank)
  set(${name}_param_bytes "${bytes}" PARENT_SCOPE)
  set(${name}_per_rank "${per_rank}" PARENT_SCOPE)
endfunction()

estimate(default 0 "precision  16-bit params" --gpu 80GB)
estimate(flag_fp32 0 "precision  fp32 params \\(4 B" --gpu 80GB --precision fp32)
estimate(config_fp32 0 "precision  fp32 params \\(4 B" --gpu 80GB --config "${WORK_DIR}/fp32.json")
estimate(config_bf16 0 "precision  16-bit params" --gpu 80GB --config "${WORK_DIR}/fp32.json" --precision bf16)
foreach(name default flag_fp32 config_fp32 config_bf16)
  read_params(${name})
endforeach()
if(NOT default_param_bytes EQUAL 2 OR NOT config_bf16_param_bytes EQUAL 2 OR NOT flag_fp32_param_bytes EQUAL 4
   OR NOT config_fp32_param_bytes EQUAL 4)
  message(FATAL_ERROR "param_bytes: default ${default_param_bytes}, --precision fp32 ${flag_fp32_param_bytes}, "
                      "fp32 config ${config_fp32_param_bytes}, fp32 config + --precision bf16 ${config_bf16_param_bytes}")
endif()
math(EXPR twice "2 * ${default_per_rank}")
if(NOT flag_fp32_per_rank EQUAL twice)
  message(FATAL_ERROR "fp32 params take ${flag_fp32_per_rank} B per rank, not twice the 16-bit ${default_per_rank}")
endif()
estimate(bad_flag 2 "fp8" --gpu 80GB --precision fp8)
# 1B params with the optimizer offloaded: 16-bit params fit 4 GB of GPU, fp32 ones do not.
estimate(fits_bf16 0 "precision  16-bit params" --precision bf16 --gpu 4GB --offload-optimizer cpu)
estimate(no_fit 1 "enable the config's \"bf16\" block" --precision fp32 --gpu 4GB --offload-optimizer cpu)
# --nvme-path replaces the config's NVMe directories (as tierzero-train's
# does): a config naming one that does not exist here plans on the given one.
file(MAKE_DIRECTORY "${WORK_DIR}/given")
file(WRITE "${WORK_DIR}/elsewhere.json" "{\"zero_optimization\": {\"stage\": 3}, \"tierzero\": {\"tiers\": {\"nvme_bytes\": \"auto\", \"nvme_paths\": [\"${WORK_DIR}/missing\"]}}}")
set(ESTIMATE_ARGS --params 1B --gpu 80GB --cpu 120GB --config "${WORK_DIR}/elsewhere.json")
estimate(config_path_missing 2 "${WORK_DIR}/missing does not exist")
estimate(nvme_path_given 0 "auto: free space on ${WORK_DIR}/given" --nvme-path "${WORK_DIR}/given")
message("estimate ok")
