/*===- RawEnumCalls.c - C API calls with out-of-range enum values ----------===*
 *
 * A C caller may pass any int where the C API takes an enum; C++ code cannot
 * even form such a value without undefined behavior (UBSan flags the load),
 * so the tests make those calls from C.
 *
 *===----------------------------------------------------------------------===*/

#include "ce/runtime/ce_runtime.h"

ce_status ce_test_check_label_status_raw(int32_t device, int32_t index,
                                         int32_t wait) {
  return ce_check_label_status((ce_device_type)device, index, 0, wait);
}
