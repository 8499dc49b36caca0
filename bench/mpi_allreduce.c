/* MPI_Allreduce of float32 (sum) as the reference ferroccl's host backend is compared against.
 * Same shape as `ferroccl bench all-reduce -d float`: warm-up iterations, a barrier, then timed
 * iterations; out of place. Prints one key=value line that bench/vs_mpi.sh parses, with the
 * nccl-tests definitions: algbw = bytes / time, busbw = algbw * 2(n-1)/n.
 *
 * usage: mpi_allreduce [bytes] [iters] [warmup]   (defaults: 64 MiB, 20, 5)
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    size_t bytes = argc > 1 ? strtoull(argv[1], NULL, 10) : (size_t)64 << 20;
    int iters = argc > 2 ? atoi(argv[2]) : 20;
    int warmup = argc > 3 ? atoi(argv[3]) : 5;
    size_t count = bytes / sizeof(float);

    float *send = malloc(count * sizeof(float));
    float *recv = malloc(count * sizeof(float));
    if (!send || !recv) {
        fprintf(stderr, "rank %d: cannot allocate 2 x %zu bytes\n", rank, bytes);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    /* Small integers keep every partial sum exact, so the result can be checked. */
    for (size_t i = 0; i < count; i++) send[i] = (float)((i + rank) % 7);

    for (int i = 0; i < warmup; i++)
        MPI_Allreduce(send, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    for (int i = 0; i < iters; i++)
        MPI_Allreduce(send, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double local = (MPI_Wtime() - t0) / iters, t;
    /* The slowest rank defines the collective's time, as in ferroccl bench. */
    MPI_Reduce(&local, &t, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);

    long wrong = 0;
    for (size_t i = 0; i < count; i++) {
        float want = 0;
        for (int r = 0; r < n; r++) want += (float)((i + r) % 7);
        wrong += recv[i] != want;
    }
    long total_wrong;
    MPI_Reduce(&wrong, &total_wrong, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);

    if (rank == 0) {
        double algbw = (double)(count * sizeof(float)) / t / 1e9;
        double busbw = algbw * 2.0 * (n - 1) / n;
        printf("mpi_allreduce nranks=%d bytes=%zu iters=%d warmup=%d time_us=%.1f algbw=%.3f busbw=%.3f wrong=%ld\n",
               n, count * sizeof(float), iters, warmup, t * 1e6, algbw, busbw, total_wrong);
    }
    free(send);
    free(recv);
    MPI_Finalize();
    return total_wrong != 0 && rank == 0;
}
