// A CUDA device with no hardware, for the simulated-GPU test tier (tests/simgpu/cards.py).
// Loaded with LD_PRELOAD before torch is imported, it registers
//  1. a device guard for DeviceType::CUDA whose streams, events and synchronisations do nothing,
//     so autograd's engine can enter a "cuda" device while it runs backward on fake tensors;
//  2. CUDA hooks saying the build has CUDA (at::getAccelerator() reports CUDA) with one device,
//     while isAvailable() and hasPrimaryContext() stay false: nothing can claim a real context.
// No kernel is provided: tensors on "cuda" must be FakeTensors (torch._subclasses.fake_tensor).
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {
using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
using c10::Stream;

struct NoGpuGuard final : c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device) const override { return Device(DeviceType::CUDA, 0); }
  Device getDevice() const override { return Device(DeviceType::CUDA, 0); }
  void setDevice(Device) const override {}
  void uncheckedSetDevice(Device) const noexcept override {}
  Stream getStream(Device d) const override { return Stream(Stream::DEFAULT, d); }
  Stream getDefaultStream(Device d) const override { return Stream(Stream::DEFAULT, d); }
  Stream getStreamFromGlobalPool(Device d, bool) const override {
    return Stream(Stream::DEFAULT, d);
  }
  Stream getNewStream(Device d, int) const override { return Stream(Stream::DEFAULT, d); }
  Stream exchangeStream(Stream s) const override { return s; }
  DeviceIndex deviceCount() const noexcept override { return 1; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  void record(void**, const Stream&, const DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const Stream&) const override {}
};

struct NoGpuHooks final : at::CUDAHooksInterface {
  explicit NoGpuHooks(at::CUDAHooksArgs) {}
  void init() const override {}  // nothing to initialise: there is no runtime
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return false; }
  bool hasPrimaryContext(DeviceIndex) const override { return false; }
  DeviceIndex deviceCount() const override { return 1; }
  DeviceIndex getCurrentDevice() const override { return 0; }
  DeviceIndex current_device() const override { return 0; }
  int getNumGPUs() const override { return 1; }
  void deviceSynchronize(DeviceIndex) const override {}
};

C10_REGISTER_GUARD_IMPL(CUDA, NoGpuGuard);
}  // namespace

namespace at {
// Preferred over any other "CUDAHooks" (a CPU build has none; a CUDA build's real one loses).
C10_REGISTER_TYPED_CLASS_WITH_PRIORITY(
    CUDAHooksRegistry, "CUDAHooks", c10::REGISTRY_PREFERRED, NoGpuHooks);
}  // namespace at
