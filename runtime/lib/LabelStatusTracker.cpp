//===- LabelStatusTracker.cpp - Status words of GPU launches --------------===//
//
// See LabelStatusTracker.h for the design. The states are never freed: a
// stream's ring is 8 KiB of page-locked memory plus its records, and a
// process uses a bounded number of streams. The words are read and cleared
// with atomic accesses because kernels write them concurrently.
//
//===----------------------------------------------------------------------===//

#include "LabelStatusTracker.h"

#include <optional>
#include <sstream>
#include <vector>

namespace ce {

namespace {

int64_t loadWord(const int64_t *word) {
  return __atomic_load_n(word, __ATOMIC_ACQUIRE);
}

void clearWord(int64_t *word) { __atomic_store_n(word, 0, __ATOMIC_RELAXED); }

/// Page-locked words the device writes at `device`.
struct WordBlock {
  int64_t *host = nullptr;
  char *device = nullptr;
  void *at(uint64_t slot) const { return device + slot * sizeof(int64_t); }
};

Status allocateWords(GpuDriver &driver, uint64_t count, WordBlock &block) {
  // Allowed while another thread captures a graph in global mode.
  RelaxedCaptureMode relaxed(driver);
  void *host = nullptr, *device = nullptr;
  if (Status status =
          driver.allocateMapped(count * sizeof(int64_t), host, device);
      !status.isOk())
    return Status::error(CE_ERROR_BACKEND,
                         "cannot allocate the label status words: " +
                             status.message());
  block.host = static_cast<int64_t *>(host);
  block.device = static_cast<char *>(device);
  for (uint64_t i = 0; i < count; ++i)
    clearWord(block.host + i);
  return Status::ok();
}

std::string streamName(void *stream) {
  if (!stream)
    return "the default stream";
  std::ostringstream text;
  text << "stream " << stream;
  return text.str();
}

/// The first unreported report found by a check, and how many others.
struct Finding {
  std::optional<LaunchRecord> first;
  int64_t word = 0;
  std::string where; ///< "launch 3 on stream 0x..."
  bool ambiguous = false;
  int64_t others = 0;

  void add(const LaunchRecord &record, int64_t value, std::string place,
           bool shared = false) {
    if (first) {
      ++others;
      return;
    }
    first = record;
    word = value;
    where = std::move(place);
    ambiguous = shared;
  }
};

} // namespace

struct LabelStatusTracker::StreamState {
  std::mutex mutex;
  WordBlock words; ///< kRingSlots ring slots, then the overflow word.
  std::vector<LaunchRecord> records = std::vector<LaunchRecord>(kRingSlots);
  uint64_t launches = 0;               ///< Launches so far.
  uint64_t ringHead = 0, ringTail = 0; ///< Ring sequence numbers in use.
  LaunchRecord overflowFirst;
  uint64_t overflowCount = 0, overflowLast = 0;
  bool overflowReported = false;
};

struct LabelStatusTracker::DeviceState {
  std::mutex mutex;
  std::vector<WordBlock> graphBlocks;
  std::vector<LaunchRecord> graphRecords;
  std::vector<uintptr_t> graphStreams; ///< Where each was captured.
};

LabelStatusTracker &LabelStatusTracker::global() {
  static LabelStatusTracker *tracker = new LabelStatusTracker();
  return *tracker;
}

Status LabelStatusTracker::streamState(GpuDriver &driver, int32_t index,
                                       void *stream, bool create,
                                       StreamState *&state) {
  StreamKey key{static_cast<int>(driver.deviceType()), index,
                reinterpret_cast<uintptr_t>(stream)};
  std::lock_guard<std::mutex> lock(mutex);
  auto found = streams.find(key);
  if (found != streams.end()) {
    state = found->second.get();
    return Status::ok();
  }
  state = nullptr;
  if (!create)
    return Status::ok();
  auto fresh = std::make_unique<StreamState>();
  if (Status status = allocateWords(driver, kRingSlots + 1, fresh->words);
      !status.isOk())
    return status;
  state = fresh.get();
  streams.emplace(key, std::move(fresh));
  return Status::ok();
}

LabelStatusTracker::DeviceState &
LabelStatusTracker::deviceState(GpuDriver &driver, int32_t index) {
  DeviceKey key{static_cast<int>(driver.deviceType()), index};
  std::lock_guard<std::mutex> lock(mutex);
  std::unique_ptr<DeviceState> &state = devices[key];
  if (!state)
    state = std::make_unique<DeviceState>();
  return *state;
}

Status LabelStatusTracker::acquire(GpuDriver &driver, int32_t index,
                                   void *stream, bool capturing,
                                   const LaunchRecord &record,
                                   void *&statusWord) {
  if (capturing) {
    DeviceState &device = deviceState(driver, index);
    std::lock_guard<std::mutex> lock(device.mutex);
    uint64_t slot = device.graphRecords.size();
    if (slot % kGraphChunkSlots == 0) {
      WordBlock block;
      if (Status status = allocateWords(driver, kGraphChunkSlots, block);
          !status.isOk())
        return status;
      device.graphBlocks.push_back(block);
    }
    device.graphRecords.push_back(record);
    device.graphRecords.back().number = slot;
    device.graphStreams.push_back(reinterpret_cast<uintptr_t>(stream));
    statusWord =
        device.graphBlocks[slot / kGraphChunkSlots].at(slot % kGraphChunkSlots);
    return Status::ok();
  }

  StreamState *state = nullptr;
  if (Status status = streamState(driver, index, stream, true, state);
      !status.isOk())
    return status;
  std::lock_guard<std::mutex> lock(state->mutex);
  uint64_t number = state->launches++;
  if (state->ringTail - state->ringHead < kRingSlots) {
    uint64_t slot = state->ringTail++ % kRingSlots;
    state->records[slot] = record;
    state->records[slot].number = number;
    statusWord = state->words.at(slot);
    return Status::ok();
  }
  if (state->overflowCount++ == 0) {
    state->overflowFirst = record;
    state->overflowFirst.number = number;
  }
  state->overflowLast = number;
  statusWord = state->words.at(kRingSlots);
  return Status::ok();
}

Status LabelStatusTracker::check(GpuDriver &driver, int32_t index, void *stream,
                                 bool wait) {
  StreamState *state = nullptr;
  if (Status status = streamState(driver, index, stream, false, state);
      !status.isOk())
    return status;
  DeviceState *device = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto found =
        devices.find(DeviceKey{static_cast<int>(driver.deviceType()), index});
    if (found != devices.end())
      device = found->second.get();
  }
  if (!state && !device)
    return Status::ok(); // Nothing was launched there.

  bool capturing = false;
  if (Status status = driver.isCapturing(stream, capturing); !status.isOk())
    return status;
  if (capturing && wait)
    return Status::invalidArgument(
        "cannot wait for " + streamName(stream) +
        ": it is capturing a graph (check with wait = 0, or after the "
        "capture ends)");

  // Launches before these snapshots have finished once the stream is seen
  // idle afterwards.
  uint64_t ringSnapshot = 0, launchSnapshot = 0;
  if (state) {
    std::lock_guard<std::mutex> lock(state->mutex);
    ringSnapshot = state->ringTail;
    launchSnapshot = state->launches;
  }
  bool finished = false;
  if (wait) {
    if (Status status = driver.synchronize(stream); !status.isOk())
      return status;
    finished = true;
  } else if (state && !capturing) {
    if (Status status = driver.isIdle(stream, finished); !status.isOk())
      return status;
  }

  Finding finding;
  std::string device_ =
      std::string(driver.apiName()) + " device " + std::to_string(index);
  if (state) {
    std::lock_guard<std::mutex> lock(state->mutex);
    for (uint64_t sequence = state->ringHead; sequence < state->ringTail;
         ++sequence) {
      uint64_t slot = sequence % kRingSlots;
      LaunchRecord &record = state->records[slot];
      int64_t value = loadWord(state->words.host + slot);
      if (value == 0 || record.reported)
        continue;
      record.reported = true;
      finding.add(record, value,
                  "launch " + std::to_string(record.number) + " on " + device_ +
                      ", " + streamName(stream));
    }
    if (state->overflowCount && !state->overflowReported) {
      if (int64_t value = loadWord(state->words.host + kRingSlots)) {
        state->overflowReported = true;
        finding.add(state->overflowFirst, value,
                    "one of the " + std::to_string(state->overflowCount) +
                        " launches from launch " +
                        std::to_string(state->overflowFirst.number) + " on " +
                        device_ + ", " + streamName(stream) +
                        ", which shared one status word because " +
                        std::to_string(kRingSlots) +
                        " launches were still unchecked",
                    true);
      }
    }
    if (finished) {
      for (uint64_t sequence = state->ringHead; sequence < ringSnapshot;
           ++sequence)
        clearWord(state->words.host + sequence % kRingSlots);
      state->ringHead = ringSnapshot;
      if (state->overflowCount && state->overflowLast < launchSnapshot) {
        clearWord(state->words.host + kRingSlots);
        state->overflowCount = 0;
        state->overflowReported = false;
      }
      // The zeros must reach memory before a later launch hands a word to a
      // kernel that may write it.
      __atomic_thread_fence(__ATOMIC_SEQ_CST);
    }
  }
  if (device) {
    std::lock_guard<std::mutex> lock(device->mutex);
    for (uint64_t slot = 0; slot < device->graphRecords.size(); ++slot) {
      int64_t *word = device->graphBlocks[slot / kGraphChunkSlots].host +
                      slot % kGraphChunkSlots;
      int64_t value = loadWord(word);
      if (value == 0)
        continue;
      // Cleared so that a later replay can report again.
      clearWord(word);
      finding.add(
          device->graphRecords[slot], value,
          "a launch captured into a graph on " + device_ + ", " +
              streamName(reinterpret_cast<void *>(device->graphStreams[slot])));
    }
  }
  if (!finding.first)
    return Status::ok();

  const LaunchRecord &record = *finding.first;
  std::string prefix = std::string(record.function) + " (" + finding.where +
                       ", variant \"" + record.context.variant.str() + "\"): ";
  std::string suffix;
  if (finding.others)
    suffix = "; " + std::to_string(finding.others) + " more launch" +
             (finding.others == 1 ? "" : "es") +
             " also met bad labels since the last check";
  if (finding.ambiguous)
    return Status::error(CE_ERROR_LABEL_OUT_OF_RANGE,
                         prefix + "a label out of range at token " +
                             std::to_string(finding.word - 1) +
                             " of one of these launches" + suffix);
  LabelReader readDevice = [&](const ce_tensor &labels, int64_t offset,
                               int64_t &label, std::string &reason) {
    int64_t size = labels.dtype == CE_DTYPE_I32 ? 4 : 8;
    const char *address =
        static_cast<const char *>(labels.data) + offset * size;
    int32_t narrow = 0;
    void *target = size == 4 ? static_cast<void *>(&narrow) : &label;
    Status status = driver.copyToHost(target, address, size);
    if (!status.isOk()) {
      reason = status.message();
      return false;
    }
    if (size == 4)
      label = narrow;
    return true;
  };
  Status error = labelStatusError(finding.word, record.context, readDevice,
                                  /*deferred=*/true);
  return Status::error(error.code(), prefix + error.message() + suffix);
}

} // namespace ce
