//===- BundleFaultTest.cpp - Damaged bundles end in errors, not signals ---===//
//
// A bundle on disk is untrusted input (DESIGN.md, section 6): a half-copied
// bundle on shared storage must not take a training job down, and a
// manifest paired with another ce-gen run's objects must not hand out
// another variant's results. Each case damages a copy of a good bundle and
// opens it; cases that damage a host object run in a child process, so that
// a signal (dlopen faulting on a truncated file) fails that case instead of
// ending the test binary.
//
// - BundleFaults.*: host objects truncated at every 64 bytes of their first
//   4 KiB and at a spread of offsets to the end, bytes of their ELF header,
//   program headers, section headers and dynamic section flipped, manifests
//   truncated and flipped at every byte, objects swapped between two
//   bundles. With the manifest's object and manifest hashes every change is
//   CE_ERROR_BUNDLE. The structural checks are also tested on their own,
//   under a manifest whose hashes vouch for the damaged file (as if it was
//   damaged before ce-gen hashed it): a truncation is still always an
//   error, a flip they let through must leave the kernel working, and a
//   damaged manifest never crashes.
// - BundleFaults.CeGen*: the same on a bundle ce-gen made (lld's layout,
//   LLVM's SHA-256), named by CE_TEST_CEGEN_BUNDLE (ctest's
//   runtime_bundle_faults_cegen sets it); skipped without it.
// - BundleIntegrity.*: the hash fields themselves, the refusal of format
//   versions 1 and 2, and GPU objects (PTX, HSACO, cubin) checked at open.
//
//===----------------------------------------------------------------------===//

#include "TestBundle.h"

#include "ObjectCheck.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cerrno>
#include <cstdlib>
#include <dlfcn.h>
#include <filesystem>
#include <fstream>
#include <functional>
#include <link.h>
#include <set>
#include <sys/wait.h>
#include <unistd.h>

using namespace ce;
using namespace ce::test;
using ::testing::HasSubstr;

namespace {

const char *kObject = "host-x86_64.so";

/// How opening a damaged bundle went.
struct Outcome {
  int signal = 0; ///< The child process died of this signal (-1: no report).
  ce_status status = CE_OK;
  bool kernelWorks = false; ///< It opened and a forward call behaved.
  std::string message;

  std::string describe() const {
    if (signal > 0)
      return "killed by signal " + std::to_string(signal) + " (" +
             strsignal(signal) + ")";
    if (signal < 0)
      return "the child process exited without a report";
    return std::string(ce_status_string(status)) +
           (status == CE_OK ? (kernelWorks ? " (kernel works)"
                                           : " (kernel not run, or wrong)")
                            : ": " + message);
  }
};

/// Opens the bundle in `dir` and, if it opens and `callKernel`, runs its
/// forward kernel.
Outcome openHere(const std::string &dir, bool callKernel) {
  Outcome outcome;
  ce_bundle *bundle = nullptr;
  std::set<uintptr_t> before = loadedObjects();
  outcome.status = ce_bundle_open(dir.c_str(), &bundle);
  outcome.message = ce_last_error_message();
  if (outcome.status == CE_OK && callKernel) {
    void *object = newlyLoadedObject(before, "ce_fake_record");
    outcome.kernelWorks = fakeForwardWorks(bundle, object);
    if (object)
      ::dlclose(object);
  }
  ce_bundle_close(bundle);
  return outcome;
}

/// openHere in a child process: a signal there is a failed case here.
Outcome openInChild(const std::string &dir, bool callKernel) {
  int signal = 0;
  std::string report = runInChild(
      [&] {
        Outcome outcome = openHere(dir, callKernel);
        return std::to_string(outcome.status) + " " +
               (outcome.kernelWorks ? "1 " : "0 ") + outcome.message;
      },
      signal);
  Outcome outcome;
  if (signal != 0) {
    outcome.signal = signal;
    if (signal < 0)
      ADD_FAILURE() << report;
    return outcome;
  }
  int status = 0, works = 0, consumed = 0;
  if (std::sscanf(report.c_str(), "%d %d %n", &status, &works, &consumed) < 2) {
    outcome.signal = -1;
    return outcome;
  }
  outcome.status = static_cast<ce_status>(status);
  outcome.kernelWorks = works != 0;
  outcome.message = report.substr(size_t(consumed));
  return outcome;
}

/// Runs cases 0..count-1, each opening a bundle directory of its own that
/// `prepare(i, dir)` fills, in child processes: one child runs cases until
/// one kills it, which is that case's outcome, and the next child resumes
/// after it. (A child per case would spend most of the time forking.) Each
/// case has a directory of its own, so that no case meets another's files;
/// directories of cases that did not open are removed at once.
std::vector<Outcome> openAllInChildren(
    size_t count, bool callKernel,
    const std::function<void(size_t, const std::string &)> &prepare) {
  TempDir root;
  std::vector<Outcome> outcomes(count);
  for (size_t next = 0; next < count;) {
    int fds[2];
    if (::pipe(fds) != 0) {
      ADD_FAILURE() << "pipe: " << std::strerror(errno);
      break;
    }
    std::fflush(nullptr);
    pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      FILE *out = ::fdopen(fds[1], "w");
      for (size_t i = next; i < count; ++i) {
        std::string dir = root.path() + "/" + std::to_string(i);
        std::filesystem::create_directory(dir);
        prepare(i, dir);
        Outcome outcome = openHere(dir, callKernel);
        if (outcome.status != CE_OK) {
          std::error_code ignored;
          std::filesystem::remove_all(dir, ignored);
        }
        std::fprintf(out, "%zu %d %d %zu\n", i, int(outcome.status),
                     int(outcome.kernelWorks), outcome.message.size());
        std::fwrite(outcome.message.data(), 1, outcome.message.size(), out);
        std::fflush(out);
      }
      ::_exit(0); // No atexit handlers, no leak check: the parent judges.
    }
    ::close(fds[1]);
    FILE *in = ::fdopen(fds[0], "r");
    size_t index, length;
    int status, works;
    size_t resume = next;
    while (std::fscanf(in, "%zu %d %d %zu", &index, &status, &works, &length) ==
               4 &&
           std::fgetc(in) == '\n' && index < count) {
      Outcome &outcome = outcomes[index];
      outcome.status = static_cast<ce_status>(status);
      outcome.kernelWorks = works != 0;
      outcome.message.resize(length);
      if (length && std::fread(outcome.message.data(), 1, length, in) != length)
        break;
      resume = index + 1;
    }
    std::fclose(in);
    int waitStatus = 0;
    while (::waitpid(pid, &waitStatus, 0) < 0 && errno == EINTR) {
    }
    if (resume < count) {
      // The case the child was running when it died.
      outcomes[resume].signal =
          WIFSIGNALED(waitStatus) ? WTERMSIG(waitStatus) : -1;
      ++resume;
    }
    next = resume;
  }
  return outcomes;
}

/// Collects the cases that went wrong and reports the first few, with a
/// count, instead of thousands of lines.
class Failures {
public:
  explicit Failures(std::string what) : what(std::move(what)) {}
  ~Failures() {
    EXPECT_EQ(count, 0u) << count << " of " << cases << " " << what
                         << " cases failed:\n"
                         << shown;
  }
  void check(bool ok, const std::string &damage, const Outcome &outcome,
             const std::string &expected) {
    ++cases;
    if (ok)
      return;
    if (++count <= 12)
      shown += "  " + damage + ": " + outcome.describe() + " (expected " +
               expected + ")\n";
  }
  size_t total() const { return cases; }

private:
  std::string what, shown;
  size_t count = 0, cases = 0;
};

/// Little-endian fields of an ELF file, for finding its headers.
uint64_t field(const std::string &file, uint64_t at, int bytes) {
  uint64_t value = 0;
  for (int i = bytes; i-- > 0;)
    value = value << 8 | uint8_t(file[at + i]);
  return value;
}

/// Byte ranges of an ELF object's headers: the ELF header, the program
/// headers, the section headers and the dynamic section.
struct HeaderRanges {
  std::vector<std::pair<uint64_t, uint64_t>> ranges; ///< (offset, size)
  explicit HeaderRanges(const std::string &file) {
    uint64_t phoff = field(file, 32, 8), phnum = field(file, 56, 2);
    uint64_t shoff = field(file, 40, 8), shnum = field(file, 60, 2);
    ranges.push_back({0, 64});
    ranges.push_back({phoff, phnum * 56});
    ranges.push_back({shoff, shnum * 64});
    for (uint64_t i = 0; i < phnum; ++i)
      if (field(file, phoff + 56 * i, 4) == 2) // PT_DYNAMIC
        ranges.push_back({field(file, phoff + 56 * i + 8, 8),
                          field(file, phoff + 56 * i + 32, 8)});
  }
};

/// Offsets at which the fault tests cut an object of `size` bytes: every 64
/// bytes of the first 4 KiB, then 48 spread to the end, and the last byte.
std::vector<size_t> truncationOffsets(size_t size) {
  std::set<size_t> offsets;
  for (size_t at = 0; at < std::min<size_t>(size, 4096); at += 64)
    offsets.insert(at);
  for (size_t k = 0; k < 48; ++k)
    offsets.insert(4096 + (size > 4096 ? (size - 4096) * k / 48 : 0));
  offsets.insert(size - 1);
  std::vector<size_t> result;
  for (size_t at : offsets)
    if (at < size)
      result.push_back(at);
  return result;
}

void writeFile(const std::string &path, const std::string &contents) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << contents;
}

/// A bundle directory holding `object` as host-x86_64.so and `manifest`.
void writeBundle(const TempDir &dir, const std::string &object,
                 const std::string &manifest) {
  dir.write(kObject, object);
  dir.write("manifest.json", manifest);
}

std::string oneKernel(int version = CE_RUNTIME_BUNDLE_VERSION,
                      const std::string &objectSha256 = "") {
  return manifestJson({{forwardKey(), "fake_forward_flat", {}}}, version,
                      objectSha256);
}

/// The manifest of a bundle whose object is `object`, its hash included:
/// the structural checks alone stand between a damaged object and dlopen.
std::string vouchingFor(const std::string &object) {
  return oneKernel(CE_RUNTIME_BUNDLE_VERSION, sha256Of(object));
}

/// A structural rejection: the checks' words, not dlopen's.
bool namesDamage(const Outcome &outcome) {
  return outcome.signal == 0 && outcome.status == CE_ERROR_BUNDLE &&
         outcome.message.find(kObject) != std::string::npos &&
         (outcome.message.find("is damaged") != std::string::npos ||
          outcome.message.find("has 0 bytes") != std::string::npos);
}

/// Truncates `object` at many offsets under `manifest` (or, when
/// `manifest` is empty, under a manifest that vouches for the cut object);
/// every cut must be rejected by the structural checks (the hash comes
/// second).
void truncateObject(const std::string &object, const std::string &manifest,
                    const std::string &what) {
  std::vector<size_t> lengths = truncationOffsets(object.size());
  std::vector<Outcome> outcomes = openAllInChildren(
      lengths.size(), false, [&](size_t i, const std::string &dir) {
        std::string cut = object.substr(0, lengths[i]);
        writeFile(dir + "/" + kObject, cut);
        writeFile(dir + "/manifest.json",
                  manifest.empty() ? vouchingFor(cut) : manifest);
      });
  Failures failures(what);
  for (size_t i = 0; i < lengths.size(); ++i)
    failures.check(namesDamage(outcomes[i]),
                   "cut to " + std::to_string(lengths[i]) + " bytes",
                   outcomes[i], "CE_ERROR_BUNDLE naming the damage");
  EXPECT_GT(failures.total(), 100u);
}

TEST(BundleFaults, TruncatedHostObjectTheHashVouchesFor) {
  // The structural checks alone.
  truncateObject(fakeKernelBytes(), "", "truncation (hash vouching for it)");
}

TEST(BundleFaults, TruncatedHostObject) {
  truncateObject(fakeKernelBytes(), oneKernel(), "truncation");
}

/// Flips bytes of `object`'s ELF header, program headers and dynamic
/// section with each of `patterns`, every 4th byte of its section headers
/// with the first, and with `stride` every stride-th byte of the file, under
/// `manifest`. With `hashed` every flip must be CE_ERROR_BUNDLE; without,
/// the manifest vouches for each flipped object (`manifest` is not used)
/// and a flip must be CE_ERROR_BUNDLE or leave the kernel working
/// (`callKernel`).
void flipObject(const std::string &object, const std::string &manifest,
                bool hashed, bool callKernel, size_t stride,
                std::vector<uint8_t> patterns, const std::string &what) {
  std::vector<std::pair<size_t, uint8_t>> flips;
  HeaderRanges headers(object);
  for (size_t r = 0; r < headers.ranges.size(); ++r) {
    auto [start, size] = headers.ranges[r];
    bool sectionHeaders = r == 2;
    for (uint64_t at = start; at < start + size && at < object.size(); ++at) {
      if (sectionHeaders && (at - start) % 4 == 0)
        flips.push_back({at, patterns[0]});
      for (uint8_t pattern : patterns)
        if (!sectionHeaders)
          flips.push_back({at, pattern});
    }
  }
  for (size_t at = 0; stride && at < object.size(); at += stride)
    flips.push_back({at, patterns[0]});
  std::vector<Outcome> outcomes = openAllInChildren(
      flips.size(), callKernel, [&](size_t i, const std::string &dir) {
        std::string damaged = object;
        damaged[flips[i].first] =
            char(damaged[flips[i].first] ^ flips[i].second);
        writeFile(dir + "/" + kObject, damaged);
        writeFile(dir + "/manifest.json",
                  hashed ? manifest : vouchingFor(damaged));
      });
  Failures failures(what);
  size_t opened = 0;
  for (size_t i = 0; i < flips.size(); ++i) {
    const Outcome &outcome = outcomes[i];
    bool ok = outcome.signal == 0 &&
              (outcome.status == CE_ERROR_BUNDLE ||
               (!hashed && outcome.status == CE_OK && outcome.kernelWorks));
    opened += outcome.signal == 0 && outcome.status == CE_OK;
    failures.check(ok,
                   "byte " + std::to_string(flips[i].first) + " ^ " +
                       std::to_string(flips[i].second),
                   outcome,
                   hashed ? "CE_ERROR_BUNDLE"
                          : "CE_ERROR_BUNDLE, or CE_OK with the kernel "
                            "working");
  }
  EXPECT_GT(failures.total(), 1000u);
  // What the structural checks let through, for the record.
  std::printf("[ %s: %zu flips, %zu opened ]\n", what.c_str(), failures.total(),
              opened);
}

TEST(BundleFaults, FlippedHeaderBytesTheHashVouchesFor) {
  // The structural checks alone.
  flipObject(fakeKernelBytes(), "", /*hashed=*/false,
             /*callKernel=*/true, /*stride=*/0, {0x01, 0x80, 0xff},
             "header flips (hash vouching for them)");
}

TEST(BundleFaults, FlippedBytes) {
  // Headers and a spread over the whole file, code and padding included:
  // the hash catches what the structure cannot.
  flipObject(fakeKernelBytes(), oneKernel(), /*hashed=*/true,
             /*callKernel=*/true, /*stride=*/61, {0x01, 0xff}, "flips");
}

/// Truncates `manifest` at every byte and flips every byte; `sealed`
/// manifests must reject every change. Without `sealed` each damaged text
/// is sealed again where its seal survives (the checks after the seal's on
/// their own): it may open but never crash. Runs in this process: no object
/// is damaged.
void damageManifest(const std::string &bundleDir, const std::string &manifest,
                    bool sealed, bool callKernel, const std::string &what) {
  std::string path = bundleDir + "/manifest.json";
  auto write = [&](const std::string &text) {
    std::ofstream(path, std::ios::binary | std::ios::trunc)
        << (sealed ? text : resealIfSealed(text));
  };
  Failures failures(what);
  size_t lastBrace = manifest.rfind('}');
  for (size_t length = 0; length < manifest.size(); ++length) {
    write(manifest.substr(0, length));
    Outcome outcome = openHere(bundleDir, callKernel);
    // Only trailing whitespace may go, and only without a seal.
    bool harmless = !sealed && length > lastBrace;
    failures.check(outcome.status == CE_ERROR_BUNDLE ||
                       (harmless && outcome.status == CE_OK &&
                        (!callKernel || outcome.kernelWorks)),
                   "cut to " + std::to_string(length) + " bytes", outcome,
                   harmless ? "CE_ERROR_BUNDLE or a working CE_OK"
                            : "CE_ERROR_BUNDLE");
  }
  for (size_t at = 0; at < manifest.size(); ++at)
    for (uint8_t pattern : {0x01, 0x20, 0x80}) {
      std::string damaged = manifest;
      damaged[at] = char(damaged[at] ^ pattern);
      write(damaged);
      Outcome outcome = openHere(bundleDir, callKernel);
      failures.check(outcome.status == CE_ERROR_BUNDLE ||
                         (!sealed && outcome.status == CE_OK),
                     "byte " + std::to_string(at) + " ^ " +
                         std::to_string(pattern),
                     outcome, sealed ? "CE_ERROR_BUNDLE" : "no crash");
    }
  write(manifest);
  Outcome intact = openHere(bundleDir, callKernel);
  EXPECT_EQ(intact.status, CE_OK) << intact.message;
}

TEST(BundleFaults, DamagedManifest) {
  TempDir dir;
  writeBundle(dir, fakeKernelBytes(), oneKernel());
  damageManifest(dir.path(), oneKernel(), /*sealed=*/true,
                 /*callKernel=*/true, "manifest damage");
}

TEST(BundleFaults, DamagedManifestSealedAgain) {
  TempDir dir;
  writeBundle(dir, fakeKernelBytes(), oneKernel());
  damageManifest(dir.path(), oneKernel(), /*sealed=*/false,
                 /*callKernel=*/true, "manifest damage (sealed again)");
}

TEST(BundleFaults, SwappedObjectsAreRejected) {
  // Two builds of the same kernels: A's manifest must not accept B's
  // object, nor B's manifest A's, and the message names the file and both
  // hashes.
  std::string a = fakeKernelBytes(), b = readFile(CE_FAKE_KERNELS_B_PATH);
  ASSERT_NE(sha256Of(a), sha256Of(b));
  TempDir dirA, dirB;
  writeBundle(dirA, a, oneKernel(CE_RUNTIME_BUNDLE_VERSION, sha256Of(a)));
  writeBundle(dirB, b, oneKernel(CE_RUNTIME_BUNDLE_VERSION, sha256Of(b)));
  EXPECT_EQ(openInChild(dirA.path(), true).describe(), "CE_OK (kernel works)");
  EXPECT_EQ(openInChild(dirB.path(), true).describe(), "CE_OK (kernel works)");
  dirA.write(kObject, b);
  dirB.write(kObject, a);
  for (auto [dir, object, manifestObject] :
       {std::tuple{&dirA, &b, &a}, std::tuple{&dirB, &a, &b}}) {
    Outcome outcome = openInChild(dir->path(), true);
    EXPECT_EQ(outcome.signal, 0) << outcome.describe();
    EXPECT_EQ(outcome.status, CE_ERROR_BUNDLE) << outcome.describe();
    EXPECT_THAT(outcome.message, HasSubstr(dir->path() + "/" + kObject));
    EXPECT_THAT(outcome.message, HasSubstr("does not match its manifest"));
    EXPECT_THAT(outcome.message, HasSubstr(sha256Of(*object)));
    EXPECT_THAT(outcome.message, HasSubstr(sha256Of(*manifestObject)));
  }
}

//--- A bundle made by ce-gen
//-------------------------------------------------//

/// The bundle ce-gen made that CE_TEST_CEGEN_BUNDLE names, copied.
class CeGenBundle {
public:
  CeGenBundle() {
    const char *source = std::getenv("CE_TEST_CEGEN_BUNDLE");
    if (!source)
      return;
    sourceDir = source;
    manifest = readFile(sourceDir + "/manifest.json");
    object = readFile(sourceDir + "/" + kObject);
    for (const auto &entry : std::filesystem::directory_iterator(sourceDir))
      std::filesystem::copy_file(
          entry.path(), dir.path() + "/" + entry.path().filename().string());
  }
  bool present() const { return !sourceDir.empty(); }

  TempDir dir;
  std::string sourceDir, manifest, object;
};

#define REQUIRE_CEGEN_BUNDLE(bundle)                                           \
  if (!(bundle).present())                                                     \
  GTEST_SKIP() << "CE_TEST_CEGEN_BUNDLE is not set (ctest's "                  \
                  "runtime_bundle_faults_cegen sets it)"

TEST(BundleFaults, CeGenBundleOpens) {
  CeGenBundle bundle;
  REQUIRE_CEGEN_BUNDLE(bundle);
  // LLVM's SHA-256 in ce-gen and the runtime's agree on the objects and the
  // manifest.
  EXPECT_THAT(bundle.manifest,
              HasSubstr("\"sha256\": \"" + sha256Of(bundle.object) + "\""));
  EXPECT_THAT(bundle.manifest, HasSubstr("\"manifest_sha256\""));
  Outcome outcome = openInChild(bundle.dir.path(), false);
  EXPECT_EQ(outcome.status, CE_OK) << outcome.describe();
}

TEST(BundleFaults, CeGenTruncatedHostObject) {
  CeGenBundle bundle;
  REQUIRE_CEGEN_BUNDLE(bundle);
  truncateObject(bundle.object, bundle.manifest, "ce-gen truncation");
}

TEST(BundleFaults, CeGenFlippedBytes) {
  CeGenBundle bundle;
  REQUIRE_CEGEN_BUNDLE(bundle);
  flipObject(bundle.object, bundle.manifest, /*hashed=*/true,
             /*callKernel=*/false, /*stride=*/bundle.object.size() / 400,
             {0x01, 0xff}, "ce-gen flips");
}

TEST(BundleFaults, CeGenDamagedManifest) {
  CeGenBundle bundle;
  REQUIRE_CEGEN_BUNDLE(bundle);
  // Every 7th byte keeps the case count near the fake bundle's.
  std::string path = bundle.dir.path() + "/manifest.json";
  Failures failures("ce-gen manifest damage");
  for (size_t at = 0; at < bundle.manifest.size(); at += 7) {
    std::string cut = bundle.manifest.substr(0, at), flipped = bundle.manifest;
    flipped[at] = char(flipped[at] ^ 0x01);
    for (const std::string *text : {&cut, &flipped}) {
      std::ofstream(path, std::ios::binary | std::ios::trunc) << *text;
      Outcome outcome = openHere(bundle.dir.path(), false);
      failures.check(outcome.status == CE_ERROR_BUNDLE,
                     (text == &cut ? "cut at " : "flip at ") +
                         std::to_string(at),
                     outcome, "CE_ERROR_BUNDLE");
    }
  }
}

//--- The hash fields and GPU objects
//------------------------------------------//

/// Opens `dir`, expects CE_ERROR_BUNDLE, and returns the message.
std::string openFails(const std::string &dir) {
  Outcome outcome = openInChild(dir, false);
  EXPECT_EQ(outcome.status, CE_ERROR_BUNDLE) << outcome.describe();
  return outcome.message;
}

std::string replaceOnce(std::string text, const std::string &from,
                        const std::string &to) {
  size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos)
    text.replace(at, from.size(), to);
  return text;
}

TEST(BundleIntegrity, BothHashesAreRequired) {
  TempDir dir;
  std::string hash = sha256Of(fakeKernelBytes());
  std::string manifest = oneKernel();
  writeBundle(dir, fakeKernelBytes(),
              sealManifest(replaceOnce(manifest, "\"sha256\"", "\"x\"")));
  EXPECT_THAT(openFails(dir.path()),
              HasSubstr("missing required key \"objects[0].sha256\""));
  writeBundle(dir, fakeKernelBytes(),
              replaceOnce(manifest, "\"manifest_sha256\"", "\"x\""));
  EXPECT_THAT(openFails(dir.path()),
              HasSubstr("missing required key \"manifest_sha256\""));
  for (const std::string &bad :
       {hash.substr(1), hash + "0", std::string(64, 'A'),
        std::string(63, '0') + "g"}) {
    SCOPED_TRACE(bad);
    writeBundle(dir, fakeKernelBytes(),
                sealManifest(replaceOnce(manifest, hash, bad)));
    EXPECT_THAT(openFails(dir.path()),
                HasSubstr("is not a SHA-256 (64 lowercase hex digits)"));
  }
  // The seal in escapes is still a SHA-256 string, but not written plainly.
  std::string seal = manifest.substr(manifest.find("manifest_sha256") + 19, 64);
  writeBundle(dir, fakeKernelBytes(),
              replaceOnce(manifest, seal, "\\u0030" + seal.substr(1)));
  EXPECT_THAT(openFails(dir.path()),
              HasSubstr("must be a SHA-256 written as 64 lowercase hex"));
}

TEST(BundleIntegrity, ChangedManifestNamesBothHashes) {
  TempDir dir;
  std::string manifest = oneKernel();
  std::string changed =
      replaceOnce(manifest, "runtime_bundle_test", "runtime_bundle_tesT");
  writeBundle(dir, fakeKernelBytes(), changed);
  std::string message = openFails(dir.path());
  EXPECT_THAT(message, HasSubstr(dir.path() + "/manifest.json has changed "
                                              "since ce-gen wrote it"));
  std::string recorded =
      manifest.substr(manifest.find("manifest_sha256") + 19, 64);
  EXPECT_THAT(message, HasSubstr("records " + recorded));
  EXPECT_THAT(message,
              HasSubstr("is " + sealManifest(changed).substr(
                                    changed.find("manifest_sha256") + 19, 64)));
}

TEST(BundleIntegrity, OlderVersionsAreRefusedEvenWithIntactHashes) {
  // A version 1 to 4 bundle whose object and manifest are intact (version
  // 1 may carry both hashes too) is refused: its kernels take no value
  // arguments, no lse_low (version 3), or no entropy and argmax (version
  // 4). The message names both versions; no object is loaded.
  std::string hash = sha256Of(fakeKernelBytes());
  std::string v1 =
      replaceOnce(oneKernel(1), "\"kind\": \"shared-object\"",
                  "\"kind\": \"shared-object\", \"sha256\": \"" + hash + "\"");
  const std::pair<std::string, int> manifests[] = {{oneKernel(1), 1},
                                                   {v1, 1},
                                                   {oneKernel(2), 2},
                                                   {oneKernel(3), 3},
                                                   {oneKernel(4), 4}};
  for (const auto &[manifest, version] : manifests) {
    SCOPED_TRACE(version);
    TempDir dir;
    writeBundle(dir, fakeKernelBytes(), manifest);
    std::string message = openFails(dir.path());
    EXPECT_THAT(message, HasSubstr(dir.path() + "/manifest.json"));
    EXPECT_THAT(message, HasSubstr(" is older than version 5, the only one "
                                   "this runtime reads"));
    EXPECT_THAT(message, HasSubstr("bundle format version " +
                                   std::to_string(version) + " is older"));
  }
}

/// A manifest of one forward kernel in `file` for `target`.
std::string gpuManifest(const std::string &target, const std::string &file,
                        const std::string &kind, const std::string &object) {
  std::string args = argsJson(canonicalArgs(forwardKey()));
  args = args.substr(1, args.size() - 2); // the array's elements
  return sealManifest(
      R"({"format": "cegen-bundle", "version": )" +
      std::to_string(CE_RUNTIME_BUNDLE_VERSION) +
      R"(, "objects": [{"file": ")" + file + R"(", "target": ")" + target +
      R"(", "kind": ")" + kind + R"(", "sha256": ")" + sha256Of(object) +
      R"("}], "kernels": [{"key": ")" + forwardKey().str() +
      R"(", "target": ")" + target + R"(", "object": ")" + file +
      R"(", "symbol": "ce_forward_0", "abi": "memref-descriptor-fields",)" +
      R"( "launch": {"block_size": 256, "rows_per_block": 1, "lds_bytes": 0},)" +
      R"( "args": [)" + args + R"(]}], "manifest_sha256": ")" +
      std::string(64, '0') + "\"}");
}

TEST(BundleIntegrity, GpuObjectsAreCheckedAtOpen) {
  struct Object {
    const char *target, *file, *kind;
    std::string bytes;
  };
  Object objects[] = {
      {"sm_90", "sm_90.ptx", "ptx", fakePtx("ce_forward_0 33")},
      {"sm_90", "sm_90.cubin", "cubin",
       fakeElf(/*EM_CUDA=*/190, /*ET_EXEC=*/2, /*OS ABI=*/0x33, "")},
      {"gfx942", "gfx942.hsaco", "hsaco", fakeHsaco("ce_forward_0 33")},
  };
  for (const Object &object : objects) {
    SCOPED_TRACE(object.file);
    TempDir dir;
    dir.write(object.file, object.bytes);
    dir.write("manifest.json", gpuManifest(object.target, object.file,
                                           object.kind, object.bytes));
    Outcome intact = openInChild(dir.path(), false);
    ASSERT_EQ(intact.status, CE_OK) << intact.describe();
    // Every cut is an error; a PTX text cut only in the whitespace after its
    // last brace passes the structure and fails the hash.
    std::string manifest = readFile(dir.path() + "/manifest.json");
    std::vector<Outcome> outcomes = openAllInChildren(
        object.bytes.size(), false, [&](size_t length, const std::string &at) {
          writeFile(at + "/" + object.file, object.bytes.substr(0, length));
          writeFile(at + "/manifest.json", manifest);
        });
    Failures failures(std::string("truncated ") + object.file);
    for (size_t length = 0; length < object.bytes.size(); ++length) {
      const Outcome &outcome = outcomes[length];
      failures.check(outcome.signal == 0 && outcome.status == CE_ERROR_BUNDLE &&
                         outcome.message.find(object.file) != std::string::npos,
                     "cut to " + std::to_string(length), outcome,
                     "CE_ERROR_BUNDLE naming the file");
    }
  }
}

TEST(ObjectCheck, Ptx) {
  std::string good = fakePtx("");
  EXPECT_EQ(checkPtx(good), "");
  EXPECT_EQ(checkPtx(good + "// a comment after the last function\n"), "");
  struct Case {
    std::string text, problem;
  } cases[] = {
      {"", "empty"},
      {replaceOnce(good, "ret;", std::string("ret;\0", 5)), "a NUL byte"},
      {replaceOnce(good, "ret;", "ret;\x01"), "a control byte"},
      {replaceOnce(good, ".version 8.0", ".vers 8.0"),
       "does not start with a .version"},
      {replaceOnce(good, ".target", ".targets"), "no .target directive"},
      {good.substr(0, good.rfind('}')), "1 unclosed '{'"},
      {good + "}", "closes nothing"},
      {replaceOnce(good, ".entry", ".func"), "no .entry"},
      {good + ".global .b8 x;", "does not end with a function's closing"},
      {good + "/* cut", "unterminated comment"},
      {replaceOnce(good, "ret;", "ret; \"cut"), "unterminated string"},
  };
  for (const Case &c : cases) {
    SCOPED_TRACE(c.problem);
    EXPECT_THAT(checkPtx(c.text), HasSubstr(c.problem));
  }
  // Braces inside comments and strings do not count.
  EXPECT_EQ(checkPtx(replaceOnce(good, "ret;", "ret; // }\n/* { */ \"{\"")),
            "");
}

TEST(ObjectCheck, ElfHeaders) {
  std::string host = fakeKernelBytes();
  EXPECT_EQ(checkElf(host, ElfKind::HostSharedObject), "");
  EXPECT_EQ(checkElf(fakeHsaco("x"), ElfKind::Hsaco), "");
  auto with = [](std::string file, size_t at, char value) {
    file[at] = value;
    return file;
  };
  struct Case {
    std::string file;
    ElfKind kind;
    const char *problem;
  } cases[] = {
      {host.substr(0, 63), ElfKind::HostSharedObject,
       "less than an ELF header"},
      {with(host, 0, 'x'), ElfKind::HostSharedObject, "no ELF magic"},
      {with(host, 4, 1), ElfKind::HostSharedObject, "not a 64-bit ELF"},
      {with(host, 5, 2), ElfKind::HostSharedObject, "not a little-endian"},
      {with(host, 7, 9), ElfKind::HostSharedObject, "OS ABI 9"},
      {with(host, 12, 1), ElfKind::HostSharedObject, "padding in e_ident"},
      {with(host, 16, 2), ElfKind::HostSharedObject,
       "ELF type 2, expected ET_DYN"},
      {host, ElfKind::Hsaco, "ELF machine 62, expected 224 (AMDGPU)"},
      {with(fakeHsaco(""), 7, 0), ElfKind::Hsaco, "OS ABI 0 is not AMDGPU HSA"},
      {with(fakeHsaco(""), 18, 62), ElfKind::Hsaco,
       "ELF machine 62, expected 224"},
      {fakeHsaco(""), ElfKind::Cubin, "ELF machine 224, expected 190 (CUDA)"},
      {host.substr(0, host.size() - 1), ElfKind::HostSharedObject,
       "truncated or corrupt: the section header table"},
      {fakeHsaco("").substr(0, 300), ElfKind::Hsaco,
       "truncated or corrupt: program header 0 (PT_LOAD)"},
  };
  for (const Case &c : cases) {
    SCOPED_TRACE(c.problem);
    EXPECT_THAT(checkElf(c.file, c.kind), HasSubstr(c.problem));
  }
}

int collectLoadedObject(dl_phdr_info *info, size_t, void *data) {
  if (info->dlpi_name && info->dlpi_name[0] == '/')
    static_cast<std::vector<std::string> *>(data)->push_back(info->dlpi_name);
  return 0;
}

TEST(ObjectCheck, EveryObjectThisProcessLoadedPasses) {
  // No false alarms on real shared objects: libc, libm, libstdc++, the
  // dynamic loader, libce_runtime itself (GNU ld's and lld's layouts,
  // symbol versions, TLS, IFUNCs, RELRO).
  std::vector<std::string> paths;
  ::dl_iterate_phdr(collectLoadedObject, &paths);
  EXPECT_GE(paths.size(), 3u);
  for (const std::string &path : paths) {
    // Earlier tests' bundles may be loaded still, their directories gone.
    if (!std::filesystem::exists(path))
      continue;
    std::string bytes = readFile(path);
    if (bytes.size() >= 20 && uint8_t(bytes[18]) == 62) { // x86-64 only
      EXPECT_EQ(checkElf(bytes, ElfKind::HostSharedObject), "") << path;
    }
  }
}

} // namespace
