//===- LabelStatusTracker.h - Status words of GPU launches ------*- C++ -*-===//
//
// Internal to the runtime (not installed). GPU launches must not synchronize,
// so a kernel's status word is read later, by ce_check_label_status. Each
// launch gets a word of its own, so that a report names the launch it came
// from:
//
// - eager launches take the next slot of a ring of words owned by their
//   (device, stream); the words are page-locked host memory mapped into the
//   device, so the host reads them without a copy. A slot returns to the ring
//   once the stream has been seen idle (or synchronized) after its launch.
//   While the ring is full, launches share one overflow word: reports still
//   arrive, but only name the first of those launches.
// - launches captured into a CUDA/HIP graph get a word of their own for
//   good, since every replay writes it again; after a report it is cleared
//   so that a later replay can report again.
//
// Words are zero when handed out and written only by kernels that meet a bad
// label, so a non-zero word is a report whether or not its kernel finished.
//
//===----------------------------------------------------------------------===//

#ifndef CE_RUNTIME_LABELSTATUSTRACKER_H
#define CE_RUNTIME_LABELSTATUSTRACKER_H

#include "GpuDriver.h"
#include "LabelStatus.h"
#include "Status.h"

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

namespace ce {

/// One GPU launch, as its status word will be read.
struct LaunchRecord {
  const char *function = ""; ///< "ce_forward", ...
  LabelContext context;
  uint64_t number = 0; ///< Launch number on its stream (or graph slot).
  bool reported = false;
};

class LabelStatusTracker {
public:
  /// Eager launches per (device, stream) that can be told apart between two
  /// checks that find the stream idle.
  static constexpr uint64_t kRingSlots = 1024;
  /// Graph-captured launches' words are allocated this many at a time.
  static constexpr uint64_t kGraphChunkSlots = 1024;

  static LabelStatusTracker &global();

  /// The status word (a device address) for a launch of `record` on
  /// `stream` of device `index`, which is current (a DeviceScope).
  Status acquire(GpuDriver &driver, int32_t index, void *stream, bool capturing,
                 const LaunchRecord &record, void *&statusWord);

  /// ce_check_label_status: reports the first launch on `stream` (or
  /// captured into a graph on the device) whose kernel met a bad label and
  /// has not been reported yet. With `wait`, synchronizes `stream` first;
  /// without it, never blocks and sees the launches that have finished.
  /// Device `index` is current.
  Status check(GpuDriver &driver, int32_t index, void *stream, bool wait);

private:
  struct StreamState;
  struct DeviceState;
  using StreamKey = std::tuple<int, int32_t, uintptr_t>;
  using DeviceKey = std::pair<int, int32_t>;

  Status streamState(GpuDriver &driver, int32_t index, void *stream,
                     bool create, StreamState *&state);
  DeviceState &deviceState(GpuDriver &driver, int32_t index);

  std::mutex mutex; ///< Guards the maps, not the states.
  std::map<StreamKey, std::unique_ptr<StreamState>> streams;
  std::map<DeviceKey, std::unique_ptr<DeviceState>> devices;
};

} // namespace ce

#endif // CE_RUNTIME_LABELSTATUSTRACKER_H
