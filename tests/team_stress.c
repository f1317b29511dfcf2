/* A stress test of src/ac_team.h for tests/test_team.py, built with
   -fsanitize=thread when a compiler can: 20 threads each run 300 jobs of
   1..40 items on 1..4 threads at once.  Every item's output is checked,
   every item runs exactly once, and slots stay below the thread count. */
#include <stdio.h>
#include <stdlib.h>
#include <pthread.h>
#include "ac_team.h"

typedef struct { double *out; int *slots; int nthreads; } ctx_t;

static double work(ptrdiff_t i)
{
    double s = 0;
    int k;
    for (k = 0; k < 2000; k++)
        s += (double)(i * k % 7);
    return s;
}

static void item(void *c, ptrdiff_t i, int slot)
{
    ctx_t *x = c;
    if (slot < 0 || slot >= x->nthreads)
        abort();
    x->out[i] = work(i);
    x->slots[slot]++;
}

static void done(void *c, int slot) { ((ctx_t *)c)->slots[slot] += 1000000; }

static void *caller(void *arg)
{
    long id = (long)arg, bad = 0;
    int r, s, i;
    for (r = 0; r < 300; r++) {
        int nt = 1 + (int)((r + id) % 4), n = 1 + (int)((r * 7 + id) % 40), ran = 0;
        ctx_t x = {calloc(n, sizeof(double)), calloc(nt, sizeof(int)), nt};
        ac_team_run(nt, n, item, done, &x);
        for (s = 0; s < nt; s++) {
            ran += x.slots[s] % 1000000;
            if ((x.slots[s] % 1000000 != 0) != (x.slots[s] >= 1000000))
                bad++;   /* done once exactly for each slot that ran items */
        }
        for (i = 0; i < n; i++)
            bad += x.out[i] != work(i);
        bad += ran != n;
        free(x.out);
        free(x.slots);
    }
    return (void *)bad;
}

int main(void)
{
    pthread_t t[20];
    long i, bad = 0;
    void *r;
    for (i = 0; i < 20; i++)
        pthread_create(&t[i], NULL, caller, (void *)i);
    for (i = 0; i < 20; i++) {
        pthread_join(t[i], &r);
        bad += (long)r;
    }
    printf("bad %ld\n", bad);
    return bad != 0;
}
