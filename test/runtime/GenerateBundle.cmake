#===- GenerateBundle.cmake - Run ce-gen into a fresh directory -------------===#
#
# cmake -DCE_GEN=<ce-gen> -DOUT_DIR=<dir> -DOPTIONS=<a;b;c> -P GenerateBundle.cmake
# Removes OUT_DIR, then runs `ce-gen OPTIONS -o OUT_DIR`, so a test never
# reads kernels left over from an older ce-gen.
#
#===------------------------------------------------------------------------===#

foreach(_var CE_GEN OUT_DIR OPTIONS)
  if(NOT DEFINED ${_var})
    message(FATAL_ERROR "GenerateBundle.cmake: ${_var} is not set")
  endif()
endforeach()

file(REMOVE_RECURSE ${OUT_DIR})
execute_process(
  COMMAND ${CE_GEN} ${OPTIONS} -o ${OUT_DIR}
  RESULT_VARIABLE _result)
if(NOT _result EQUAL 0)
  message(FATAL_ERROR "ce-gen failed (${_result}): ${CE_GEN} ${OPTIONS} -o ${OUT_DIR}")
endif()
if(NOT EXISTS ${OUT_DIR}/manifest.json)
  message(FATAL_ERROR "ce-gen wrote no ${OUT_DIR}/manifest.json")
endif()
