// Whether relaunching kernels through one-node CUDA graphs (1.05-1.8 us a launch for the caller
// against 2.4-3.3 for cuLaunchKernelEx, launch_cost.cu) is safe for kernels that wait for each
// other, on one GPU: a kernel of the same context spins (as a rank's kernel waits for a rank
// sharing its GPU, or for a peer whose next launch this thread makes) while the host makes,
// uploads, resets, relaunches and destroys graphs. A call that waits for the spinning kernel takes
// until the spin's own deadline (SPIN_MS) and the spin reports that it gave up; one that does not
// takes microseconds. Also: many graphs' launches pending at once, many live graphs relaunched
// and reset from one thread or two (each launch checked to run with its own graph's parameter),
// and each call's cost with nothing running.
//
// Session 38 (one H200, driver 580.159.04): the 34th graph made in the context while a kernel
// spun waited for that kernel's whole deadline (by the look of it, the driver growing what it
// keeps for graphs); every other call, and 80 live graphs reset and relaunched from two
// threads, ran without waiting and with their own parameters. While a make waits, another
// thread's launch into the context (a kernel's or a graph's) waits too (case 0: 250 ms, until
// the spin gave up), so making graphs off the launching threads does not help. ferroccl's graph
// launches (509db8b, reverted) hung so with two ranks sharing a GPU at their 15th graph each.
//
//   nvcc -O2 -arch=sm_90 -o graph_relaunch bench/probes/graph_relaunch.cu -lcuda && ./graph_relaunch
//   ./graph_relaunch graph-setter   # case 0 alone, the spin freed by a graph's launch
// (spin.cuh, beside it, holds what it shares with driver_waits.cu.)
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "spin.cuh"

struct Small { int* out; int v; };
// A parameter of the engines' size (the direct engine's is 376 bytes): the value to store is
// spread over it, so a launch that ran with another graph's parameter stores the wrong value.
struct Big { int* out; int v[92]; };
__global__ void set_word(int* w) { *(volatile int*)w = 1; }
__global__ void big(Big p) {
    if (threadIdx.x == 0) { int s = 0; for (int i = 0; i < 92; i++) s += p.v[i]; *p.out = s; }
}
__global__ void small(Small p) { if (threadIdx.x == 0) *p.out = p.v; }

// A one-block launch of f (32 threads) with `params`, as a graph's kernel node takes it.
static CUDA_KERNEL_NODE_PARAMS node_params(CUfunction f, void** params, int blocks) {
    CUDA_KERNEL_NODE_PARAMS kp = {};
    kp.func = f;
    kp.gridDimX = blocks; kp.gridDimY = 1; kp.gridDimZ = 1;
    kp.blockDimX = 32; kp.blockDimY = 1; kp.blockDimZ = 1;
    kp.kernelParams = params;
    return kp;
}

static CUgraphExec one_node(CUfunction f, void** params, CUgraph* g, CUgraphNode* node, int blocks) {
    CK(cuGraphCreate(g, 0));
    const CUDA_KERNEL_NODE_PARAMS kp = node_params(f, params, blocks);
    CK(cuGraphAddKernelNode(node, *g, nullptr, 0, &kp));
    CUgraphExec e;
    CK(cuGraphInstantiate(&e, *g, 0));
    return e;
}

// n one-node graphs of `big`, graph i storing the sum of its parameter's values into word i;
// destroyed with the set.
struct BigGraphs {
    std::vector<Big> ps;
    std::vector<CUgraph> gs;
    std::vector<CUgraphNode> ns;
    std::vector<CUgraphExec> es;
    int* words = nullptr;
    explicit BigGraphs(int n) : ps(n), gs(n), ns(n), es(n, nullptr) {
        CK(cuMemAlloc((CUdeviceptr*)&words, n * sizeof(int)));
    }
    // Makes graph i (its parameter's values all i); returns the make's time, us.
    double make(int i) {
        ps[i].out = words + i;
        for (int k = 0; k < 92; k++) ps[i].v[k] = i;
        void* pp[1] = {&ps[i]};
        auto t = clk::now();
        es[i] = one_node(fn((const void*)big), pp, &gs[i], &ns[i], 1);
        return us_since(t);
    }
    ~BigGraphs() {
        for (size_t i = 0; i < es.size(); i++)
            if (es[i]) { CK(cuGraphExecDestroy(es[i])); CK(cuGraphDestroy(gs[i])); }
        CK(cuMemFree((CUdeviceptr)words));
    }
};

int main(int argc, char** argv) {
    CK(cuInit(0));
    RK(cudaSetDevice(0));
    RK(cudaFree(0));
    CUstream a, b;
    CK(cuStreamCreate(&a, CU_STREAM_NON_BLOCKING));
    CK(cuStreamCreate(&b, CU_STREAM_NON_BLOCKING));
    Spinner spinner;
    int* outs;
    CK(cuMemAlloc((CUdeviceptr*)&outs, 256));
    CUfunction fspin = spinner.f, fsmall = fn((const void*)small);
    Spin sp = spinner.at(0);
    void* spin_params[1] = {&sp};
    Small sm = {outs + 8, 5};
    void* small_params[1] = {&sm};
    auto arm = [&]() { spinner.arm(); };
    auto release = [&](int i) { spinner.release(i); };
    auto gave_up = [&](int i) { return spinner.ended(i); };
    std::printf("spin deadline %lld ms; us per call\n", SPIN_MS);

    // 0. A thread making graphs, blocked by a spinning kernel: does another thread's launch (a
    // kernel's, or with `graph-setter` a graph's made before) of the kernel that frees the spin
    // go through? If it does, graphs can be made off the launching threads: such a make waits
    // only until the context's kernels move on by themselves.
    {
        const bool graph_setter = argc > 1 && std::strcmp(argv[1], "graph-setter") == 0;
        CUfunction fset = fn((const void*)set_word);
        CUcontext ctx;
        CK(cuCtxGetCurrent(&ctx));
        int* w0 = spinner.dev;
        void* setp[1] = {&w0};
        CUgraph gset; CUgraphNode nset;
        CUgraphExec eset = one_node(fset, setp, &gset, &nset, 1);
        const int MANY = 96;
        BigGraphs graphs(MANY);
        arm();
        spinner.launch(a);
        std::atomic<int> made{0};
        double slowest = 0;
        int slow_i = -1;
        std::thread maker([&] {
            CK(cuCtxSetCurrent(ctx));
            for (int i = 0; i < MANY; i++) {
                const double m = graphs.make(i);
                if (m > slowest) { slowest = m; slow_i = i; }
                made++;
            }
        });
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        int made_then = made.load();
        auto t0 = clk::now();
        if (graph_setter) CK(cuGraphLaunch(eset, b));
        else CK(cuLaunchKernel(fset, 1, 1, 1, 1, 1, 1, 0, b, setp, nullptr));
        double setter = us_since(t0);
        maker.join();
        std::printf("a thread making graphs while a kernel spins: %d made when another thread launched the %s that frees the spin (the launch %.1f us); slowest make %.1f us (graph %d); spin %s\n",
                    made_then, graph_setter ? "graph" : "kernel", setter, slowest, slow_i, gave_up(0));
        CK(cuGraphExecDestroy(eset)); CK(cuGraphDestroy(gset));
        if (argc > 1) return 0;
    }

    // 1. First: making and first launching many graphs while a kernel of the context spins (a rank
    // sharing the GPU, waiting for this thread's next launch): does any of them wait for it?
    {
        const int MANY = 96;
        BigGraphs graphs(MANY);
        arm();
        spinner.launch(a);
        int slow_make = -1, slow_launch = -1;
        double most_make = 0, most_launch = 0;
        for (int i = 0; i < MANY; i++) {
            const double m = graphs.make(i);
            if (m > most_make) { most_make = m; slow_make = i; }
            auto t1 = clk::now();
            CK(cuGraphLaunch(graphs.es[i], b));
            double l = us_since(t1);
            if (l > most_launch) { most_launch = l; slow_launch = i; }
        }
        release(0);
        std::printf("%d graphs made and launched while a kernel spins: slowest make %.1f us (graph %d), slowest first launch %.1f us (graph %d); spin %s\n",
                    MANY, most_make, slow_make, most_launch, slow_launch, gave_up(0));
    }

    // 2. Many graphs' launches pending at once, as a rank's graph kernels wait for a rank that
    // shares its GPU: GRAPHS one-node graphs of the spinning kernel, each on its own word, each
    // launched once (all spinning together), on one stream each or all on one. A launch that
    // waits for an earlier one takes until that one's deadline.
    for (int streams : {64, 1}) {
        const int GRAPHS = 48;
        static Spin ps[GRAPHS];
        void* pp[GRAPHS][1];
        CUgraph gs[GRAPHS]; CUgraphNode ns[GRAPHS]; CUgraphExec es[GRAPHS];
        CUstream ss[GRAPHS];
        arm();
        for (int i = 0; i < GRAPHS; i++) {
            ps[i] = spinner.at(16 + i);
            pp[i][0] = &ps[i];
            es[i] = one_node(fspin, pp[i], &gs[i], &ns[i], 1);
            if (streams > 1) CK(cuStreamCreate(&ss[i], CU_STREAM_NON_BLOCKING)); else ss[i] = a;
        }
        int slow = -1;
        double most = 0;
        auto t0 = clk::now();
        for (int i = 0; i < GRAPHS; i++) {
            auto t1 = clk::now();
            CK(cuGraphLaunch(es[i], streams > 1 ? ss[i] : a));
            double t = us_since(t1);
            if (t > most) { most = t; slow = i; }
        }
        double all = us_since(t0);
        for (int i = 0; i < GRAPHS; i++) release(16 + i);
        CK(cuCtxSynchronize());
        std::printf("%d graphs' launches pending at once on %d stream(s): all %.1f us, slowest launch %.1f (graph %d)\n",
                    GRAPHS, streams > 1 ? GRAPHS : 1, all, most, slow);
        for (int i = 0; i < GRAPHS; i++) {
            CK(cuGraphExecDestroy(es[i])); CK(cuGraphDestroy(gs[i]));
            if (streams > 1) CK(cuStreamDestroy(ss[i]));
        }
    }

    // 3. Many live graphs, each relaunched and reset, from one thread or two at once (as two
    // ranks sharing a GPU): does every launch run with its own graph's parameter? Each graph's
    // kernel stores a value spread over its 376-byte parameter into its own word; every round
    // checks every word.
    {
        CUfunction fbig = fn((const void*)big);
        for (int threads : {1, 2}) {
            for (int per : {8, 16, 24, 40}) {
                const int n = per * threads, ROUNDS = 20;
                int* words;
                CK(cuMemAlloc((CUdeviceptr*)&words, n * sizeof(int)));
                std::vector<int> bad(threads, 0);
                auto body = [&](int t) {
                    CUstream s;
                    CK(cuCtxSetCurrent(nullptr));
                    RK(cudaSetDevice(0));
                    CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
                    std::vector<Big> ps(per);
                    std::vector<CUgraph> gs(per);
                    std::vector<CUgraphNode> ns(per);
                    std::vector<CUgraphExec> es(per);
                    std::vector<int> host(per);
                    for (int r = 0; r < ROUNDS; r++) {
                        for (int i = 0; i < per; i++) {
                            int w = t * per + i;
                            Big& b = ps[i];
                            b.out = words + w;
                            for (int k = 0; k < 92; k++) b.v[k] = (w * 131 + r * 7 + k) % 1000;
                            void* pp[1] = {&b};
                            if (r == 0) {
                                es[i] = one_node(fbig, pp, &gs[i], &ns[i], 1);
                            } else if (r % 2 == 0) {
                                const CUDA_KERNEL_NODE_PARAMS kp = node_params(fbig, pp, 1);
                                CK(cuGraphExecKernelNodeSetParams(es[i], ns[i], &kp));
                            }
                            int v = 0;
                            for (int k = 0; k < 92; k++) v += b.v[k];
                            // Odd rounds relaunch as is: the parameter of the round before.
                            if (r % 2 == 1) { int pv = 0; for (int k = 0; k < 92; k++) pv += (w * 131 + (r - 1) * 7 + k) % 1000; v = pv; }
                            host[i] = v;
                            CK(cuGraphLaunch(es[i], s));
                        }
                        CK(cuStreamSynchronize(s));
                        std::vector<int> got(per);
                        CK(cuMemcpyDtoH(got.data(), (CUdeviceptr)(words + t * per), per * sizeof(int)));
                        for (int i = 0; i < per; i++) if (got[i] != host[i]) bad[t]++;
                    }
                    for (int i = 0; i < per; i++) { CK(cuGraphExecDestroy(es[i])); CK(cuGraphDestroy(gs[i])); }
                    CK(cuStreamDestroy(s));
                };
                if (threads == 1) body(0);
                else { std::thread x(body, 0), y(body, 1); x.join(); y.join(); }
                int total = 0;
                for (int b : bad) total += b;
                std::printf("%d thread(s), %d live graphs each, %d rounds: %d launches stored a wrong value\n",
                            threads, per, ROUNDS, total);
                CK(cuMemFree((CUdeviceptr)words));
            }
        }
    }

    for (int rep = 0; rep < 2; rep++) {
        std::printf("-- pass %d\n", rep + 1);
        // 4. Making (instantiating) a graph while another stream's kernel spins (pass 1: a
        // kernel launched; pass 2: a graph's).
        arm();
        CUgraph gsp; CUgraphNode nsp;
        CUgraphExec esp = one_node(fspin, spin_params, &gsp, &nsp, 1);
        if (rep == 0) spinner.launch(a); else CK(cuGraphLaunch(esp, a));
        CUgraph g1; CUgraphNode n1;
        auto t0 = clk::now();
        CUgraphExec e1 = one_node(fsmall, small_params, &g1, &n1, 1);
        double make = us_since(t0);
        // 5. Its first launch (the upload) on another stream.
        t0 = clk::now();
        CK(cuGraphLaunch(e1, b));
        double first = us_since(t0);
        t0 = clk::now();
        CK(cuGraphLaunch(e1, b));
        double second = us_since(t0);
        release(0);
        std::printf("while a %s spins: make %.1f, first launch %.1f, second %.1f; spin %s\n",
                    rep == 0 ? "kernel" : "graph's kernel", make, first, second, gave_up(0));
        CK(cuGraphExecDestroy(esp)); CK(cuGraphDestroy(gsp));

        // 6. A graph of the spinning kernel itself: reset its parameter while its launch spins
        // (a rank's next call with new buffers while its last kernel waits for its peer).
        arm();
        CUgraph g2; CUgraphNode n2;
        CUgraphExec e2 = one_node(fspin, spin_params, &g2, &n2, 1);
        CK(cuGraphLaunch(e2, a));
        CK(cuStreamSynchronize(a));  // uploaded and run once (gives up after SPIN_MS)
        arm();
        CK(cuGraphLaunch(e2, a));
        Spin sp2 = spinner.at(1);
        void* p2[1] = {&sp2};
        const CUDA_KERNEL_NODE_PARAMS kp = node_params(fspin, p2, 1);
        t0 = clk::now();
        CK(cuGraphExecKernelNodeSetParams(e2, n2, &kp));
        double reset = us_since(t0);
        t0 = clk::now();
        CK(cuGraphLaunch(e2, a));
        double relaunch = us_since(t0);
        release(0);
        release(1);
        std::printf("reset while its own launch spins: set %.1f, launch %.1f; first spin %s\n", reset, relaunch, gave_up(0));

        // 7. The same graph relaunched as it is while its launch spins.
        arm();
        CK(cuGraphExecKernelNodeSetParams(e2, n2, &kp));
        CK(cuGraphLaunch(e2, a));
        t0 = clk::now();
        CK(cuGraphLaunch(e2, a));
        double again = us_since(t0);
        release(1);
        std::printf("relaunched as it is while its launch spins: launch %.1f; spin %s\n", again, gave_up(1));

        // 8. Destroying graphs while another stream's kernel spins: one launched and done, one
        // never launched.
        {
            CUgraph g3, g4; CUgraphNode n3, n4;
            CUgraphExec e3 = one_node(fsmall, small_params, &g3, &n3, 1);
            CUgraphExec e4 = one_node(fsmall, small_params, &g4, &n4, 2);
            CK(cuGraphLaunch(e3, b));
            CK(cuStreamSynchronize(b));
            arm();
            spinner.launch(a);
            t0 = clk::now();
            CK(cuGraphExecDestroy(e3));
            double d_done = us_since(t0);
            t0 = clk::now();
            CK(cuGraphDestroy(g3));
            double d_graph = us_since(t0);
            t0 = clk::now();
            CK(cuGraphExecDestroy(e4));
            double d_never = us_since(t0);
            CK(cuGraphDestroy(g4));
            release(0);
            std::printf("destroy while a kernel spins: exec launched and done %.1f, its graph %.1f, exec never launched %.1f; spin %s\n",
                        d_done, d_graph, d_never, gave_up(0));
            // An exec whose own launch spins.
            CUgraph g5; CUgraphNode n5;
            arm();
            CUgraphExec e5 = one_node(fspin, spin_params, &g5, &n5, 1);
            CK(cuGraphLaunch(e5, a));
            t0 = clk::now();
            CK(cuGraphExecDestroy(e5));
            double d_own = us_since(t0);
            CK(cuGraphDestroy(g5));
            release(0);
            std::printf("destroy an exec whose own launch spins: %.1f; spin %s\n", d_own, gave_up(0));
        }

        // 9. Nothing running: each call's cost (mean of 1000).
        arm();
        release(0); release(1);
        const int N = 1000;
        const CUDA_KERNEL_NODE_PARAMS ks = node_params(fsmall, small_params, 1);
        t0 = clk::now();
        for (int i = 0; i < N; i++) { sm.v = i; CK(cuGraphExecKernelNodeSetParams(e1, n1, &ks)); }
        CK(cuCtxSynchronize());
        double set_idle = us_since(t0) / N;
        double set_launch = 0;
        for (int i = 0; i < N; i++) {
            if (i % 256 == 0) CK(cuStreamSynchronize(b));
            sm.v = i;
            auto t1 = clk::now();
            CK(cuGraphExecKernelNodeSetParams(e1, n1, &ks));
            CK(cuGraphLaunch(e1, b));
            set_launch += us_since(t1);
        }
        CK(cuCtxSynchronize());
        double makes = 0;
        for (int i = 0; i < 50; i++) {
            CUgraph g; CUgraphNode n;
            auto t1 = clk::now();
            CUgraphExec e = one_node(fsmall, small_params, &g, &n, 1 + i);
            makes += us_since(t1);
            CK(cuGraphExecDestroy(e));
            CK(cuGraphDestroy(g));
        }
        std::printf("idle: set %.2f, set + launch %.2f, make %.1f\n", set_idle, set_launch / N, makes / 50);
        CK(cuGraphExecDestroy(e1)); CK(cuGraphDestroy(g1));
        CK(cuGraphExecDestroy(e2)); CK(cuGraphDestroy(g2));
    }
    return 0;
}
