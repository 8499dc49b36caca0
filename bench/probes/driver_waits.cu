// Which driver calls wait for a kernel of their context, on one GPU. ferroccl's kernels wait for
// each other (ranks sharing a GPU, communicators of one process, a peer whose matching launch
// this thread makes next), so a call made while one of them spins that waits for every kernel
// of the context deadlocks until a deadline; `graph_relaunch.cu` found a graph's make to be one.
// Here a kernel spins on a non-blocking stream (until SPIN_MS, or until the host frees it) while
// each call that ferroccl makes after a communicator's creation, or might, is timed once, with a
// fresh spin each: a call that took most of SPIN_MS waited (and the spin says it gave up).
//
// Last, CUDA IPC (how ferroccl lends `cudaMalloc` memory between processes): a child process
// opens and closes a parent's allocation while a kernel of its own context spins.
//
//   nvcc -O2 -arch=sm_90 -o driver_waits bench/probes/driver_waits.cu -lcuda && ./driver_waits
#include <functional>
#include <sys/wait.h>
#include <unistd.h>

#include "spin.cuh"

// A small module for cuModuleLoadData: PTX of one empty kernel (JIT-compiled by the driver).
static const char* PTX =
    ".version 8.0\n.target sm_90\n.address_size 64\n"
    ".visible .entry empty() { ret; }\n";

// Times f() while a kernel of the context spins on s, and prints the line of `name`.
static void timed(Spinner& spinner, CUstream s, const char* name, const std::function<void()>& f) {
    spinner.arm();
    spinner.launch(s);
    auto t0 = clk::now();
    f();
    const double us = us_since(t0);
    spinner.release(0);
    std::printf("%-42s %10.1f us  %s\n", name, us, spinner.gave_up(0) ? "WAITED for the spinning kernel" : "");
}

// The child of the IPC case: opens the parent's allocation and closes it, each while a kernel of
// its own context spins.
static int ipc_child(int rfd) {
    CUipcMemHandle handle;
    if (read(rfd, &handle, sizeof handle) != (ssize_t)sizeof handle) return 1;
    CK(cuInit(0));
    RK(cudaSetDevice(0));
    RK(cudaFree(0));
    CUstream a;
    CK(cuStreamCreate(&a, CU_STREAM_NON_BLOCKING));
    Spinner spinner;
    CUdeviceptr p = 0;
    timed(spinner, a, "cuIpcOpenMemHandle (another process's)",
          [&] { CK(cuIpcOpenMemHandle(&p, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)); });
    timed(spinner, a, "cuIpcCloseMemHandle", [&] { CK(cuIpcCloseMemHandle(p)); });
    std::fflush(stdout);
    return 0;
}

int main() {
    // The IPC case's child first, before this process touches CUDA (fork after would not do).
    int fds[2];
    if (pipe(fds) != 0) return 1;
    std::fflush(stdout);
    pid_t child = fork();
    if (child == 0) { close(fds[1]); return ipc_child(fds[0]); }
    close(fds[0]);
    CK(cuInit(0));
    RK(cudaSetDevice(0));
    RK(cudaFree(0));
    CUdevice dev;
    CK(cuCtxGetDevice(&dev));
    CUstream a;
    CK(cuStreamCreate(&a, CU_STREAM_NON_BLOCKING));
    Spinner spinner;

    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t gran = 0;
    CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CUmemAccessDesc access = {};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;

    // State the calls share (made by one, undone by a later one).
    CUdeviceptr plain = 0, va = 0, va2 = 0;
    CUmemGenericAllocationHandle h = 0, h2 = 0;
    int fd = -1;
    void* hostp = nullptr;
    static char reg[1 << 16];
    CUevent ev = nullptr;
    CUstream s2 = nullptr;
    CUmodule mod = nullptr;
    CUdeviceptr big = 0;

    struct Call { const char* name; std::function<void()> f; };
    Call calls[] = {
        {"cuMemAlloc 1 MiB", [&] { CK(cuMemAlloc(&plain, 1 << 20)); }},
        {"cuMemFree", [&] { CK(cuMemFree(plain)); }},
        {"cuMemCreate (fd handle)", [&] { CK(cuMemCreate(&h, gran, &prop, 0)); }},
        {"cuMemAddressReserve", [&] { CK(cuMemAddressReserve(&va, gran, 0, 0, 0)); }},
        {"cuMemMap", [&] { CK(cuMemMap(va, gran, 0, h, 0)); }},
        {"cuMemSetAccess", [&] { CK(cuMemSetAccess(va, gran, &access, 1)); }},
        {"cuMemExportToShareableHandle", [&] {
             CK(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)); }},
        {"cuMemImportFromShareableHandle", [&] {
             CK(cuMemImportFromShareableHandle(&h2, (void*)(long)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)); }},
        {"cuMemMap + cuMemSetAccess of the import", [&] {
             CK(cuMemAddressReserve(&va2, gran, 0, 0, 0));
             CK(cuMemMap(va2, gran, 0, h2, 0));
             CK(cuMemSetAccess(va2, gran, &access, 1)); }},
        {"cuMemUnmap of the import", [&] { CK(cuMemUnmap(va2, gran)); }},
        {"cuMemRelease of the import", [&] { CK(cuMemRelease(h2)); CK(cuMemAddressFree(va2, gran)); close(fd); }},
        {"cuMemUnmap", [&] { CK(cuMemUnmap(va, gran)); }},
        {"cuMemRelease", [&] { CK(cuMemRelease(h)); }},
        {"cuMemAddressFree", [&] { CK(cuMemAddressFree(va, gran)); }},
        {"cuMemHostAlloc 1 MiB", [&] { CK(cuMemHostAlloc(&hostp, 1 << 20, CU_MEMHOSTALLOC_DEVICEMAP)); }},
        {"cuMemFreeHost", [&] { CK(cuMemFreeHost(hostp)); }},
        {"cuMemHostRegister 64 KiB", [&] { CK(cuMemHostRegister(reg, sizeof reg, CU_MEMHOSTREGISTER_DEVICEMAP)); }},
        {"cuMemHostUnregister", [&] { CK(cuMemHostUnregister(reg)); }},
        {"cuEventCreate", [&] { CK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING)); }},
        {"cuEventDestroy", [&] { CK(cuEventDestroy(ev)); }},
        {"cuStreamCreate", [&] { CK(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING)); }},
        {"cuStreamDestroy", [&] { CK(cuStreamDestroy(s2)); }},
        {"cuModuleLoadData (PTX)", [&] { CK(cuModuleLoadData(&mod, PTX)); }},
        {"cuModuleUnload", [&] { CK(cuModuleUnload(mod)); }},
        {"cuMemAlloc 256 MiB", [&] { CK(cuMemAlloc(&big, 256 << 20)); }},
        {"cuMemcpyHtoD 64 B (synchronous)", [&] { static int v[16]; CK(cuMemcpyHtoD(big, v, sizeof v)); }},
        {"cuMemsetD8 (synchronous)", [&] { CK(cuMemsetD8(big, 0, 64)); }},
        {"cuMemFree 256 MiB", [&] { CK(cuMemFree(big)); }},
    };
    std::printf("spin deadline %lld ms; a call that waited takes most of it\n", SPIN_MS);
    for (auto& c : calls) timed(spinner, a, c.name, c.f);
    std::fflush(stdout);
    CUdeviceptr lent;
    CK(cuMemAlloc(&lent, 1 << 20));
    CUipcMemHandle handle;
    CK(cuIpcGetMemHandle(&handle, lent));
    if (write(fds[1], &handle, sizeof handle) != (ssize_t)sizeof handle) return 1;
    int status = 0;
    waitpid(child, &status, 0);
    CK(cuMemFree(lent));
    return status;
}
