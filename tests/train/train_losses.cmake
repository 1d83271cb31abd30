# read_losses(csv prefix): sets <prefix>_<step> to each step's loss, as
# tierzero-train's loss.csv writes it (columns: step,loss,...).
function(read_losses csv prefix)
  file(STRINGS "${csv}" lines)
  foreach(line IN LISTS lines)
    if(line MATCHES "^([0-9]+),([^,]+),")
      set(${prefix}_${CMAKE_MATCH_1} "${CMAKE_MATCH_2}" PARENT_SCOPE)
    endif()
  endforeach()
endfunction()
