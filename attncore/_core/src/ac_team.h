/* attncore's own thread team for the decode-sized kernel regions.
 *
 * Why not an OpenMP region: with the default wait policy an OpenMP runtime
 * (GNU's) spins its idle threads for up to milliseconds after every region
 * and at its barriers, and the thread that opened a region waits at its end
 * for every member of the team, started or not.  When another process (or
 * another runtime's threads in the same process: torch's) holds a core, a
 * member that has not been scheduled yet stalls the whole call by a
 * scheduler time slice.  Measured on 2 vCPUs beside one spinning process:
 * 16 decode calls at two threads took 12x their one-thread time.  The wait
 * policy cannot be changed at run time without touching the whole process.
 *
 * This team:
 *   - the calling thread works too (slot 0) and claims items one at a time
 *     from a shared counter, as every member does; it never waits for a
 *     member that has not started: a member that wakes late finds nothing
 *     left and goes back to sleep;
 *   - at the end the caller waits only for members that joined (each
 *     finishes the item it holds), sleeping on a condition variable after
 *     a short spin, so its core goes to whoever needs it;
 *   - idle members spin briefly (AC_TEAM_SPIN_NS) for the next call, then
 *     sleep on a condition variable: they never hold a core for long;
 *   - calls from several threads at once each take a team of their own
 *     (AC_TEAMS of them; beyond that a call runs on its calling thread,
 *     with the same result);
 *   - members are started when a call first asks for them (detached
 *     pthreads, never stopped).
 *
 * Which thread runs which item changes nothing in the result: every item
 * writes its own outputs, and per-slot state (scratch) is the callback's.
 * Without OpenMP (the serial builds), or off POSIX, everything runs on the
 * calling thread.
 */
#ifndef AC_TEAM_H
#define AC_TEAM_H

#include <stddef.h>

/* item(ctx, i, slot): run item i on the calling thread, which is member
   `slot` (0: the caller, 1 .. nthreads - 1: the others, each on one
   thread for the whole job); done(ctx, slot): called once by each member
   that ran at least one item, on its own thread, after its last one. */
typedef void (*ac_team_item_fn)(void *ctx, ptrdiff_t i, int slot);
typedef void (*ac_team_done_fn)(void *ctx, int slot);

#if defined(_OPENMP) && (defined(__unix__) || defined(__APPLE__))
#define AC_TEAM_THREADS 1
#include <pthread.h>
#include <sched.h>
#include <time.h>

/* Idle members poll for the next call AC_TEAM_SPIN_NS, then sleep; past
 * the first AC_TEAM_HOT_NS each poll yields the core (sched_yield), so
 * that another runnable thread -- another process, torch's threads -- gets
 * it at once, while on a quiet core the member stays awake for the next
 * call.  Measured (Emerald Rapids, 2 vCPUs, bench/busy_cpu.py, quiet,
 * 16 GQA decode calls, 2 threads): a 50 us spin then sleep, 13.6-19.2 ms
 * (the calls of a decode loop find the members asleep), against 9.0-9.6
 * for OpenMP's regions; a 1 ms spin of pauses 9.3-10.0 ms, but 1.4-1.5x
 * the one-thread time beside a spinning process or an OpenMP program. */
#ifndef AC_TEAM_SPIN_NS
#define AC_TEAM_SPIN_NS 1000000L
#endif
#ifndef AC_TEAM_HOT_NS
#define AC_TEAM_HOT_NS 50000L
#endif
#ifndef AC_TEAM_JOIN_SPIN_NS
#define AC_TEAM_JOIN_SPIN_NS 20000L  /* the caller's, for members finishing */
#endif
#define AC_TEAM_MAX 1024

typedef struct {
    ac_team_item_fn item;
    ac_team_done_fn done;
    void *ctx;
    ptrdiff_t n;
    ptrdiff_t next;   /* atomic: the next unclaimed item */
    int want;         /* members wanted besides the caller (under mu) */
    int joined;       /* members that joined (under mu) */
    int refs;         /* atomic: joined members still running */
} ac_team_job;

/* One team: a caller takes a free one for its call (as an OpenMP runtime
   gives each thread that opens a region a pool of its own), so calls from
   several threads at once each have members; past AC_TEAMS at once, a call
   runs on its calling thread. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t wake;      /* a new job */
    pthread_cond_t idle;      /* a member left the job */
    ac_team_job *job;         /* under mu: the job open to members, or NULL */
    unsigned long gen;        /* atomic: bumped for every job */
    int started;              /* under mu: members started */
    int busy;                 /* atomic: a caller holds this team */
} ac_team_t;

#define AC_TEAMS 16
static ac_team_t ac_teams[AC_TEAMS];
static pthread_once_t ac_teams_once = PTHREAD_ONCE_INIT;

static void ac_teams_init(void)
{
    int i;
    for (i = 0; i < AC_TEAMS; i++) {
        pthread_mutex_init(&ac_teams[i].mu, NULL);
        pthread_cond_init(&ac_teams[i].wake, NULL);
        pthread_cond_init(&ac_teams[i].idle, NULL);
    }
}

static inline void ac_team_pause(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline long ac_team_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long)ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* Spin until *word != seen or ns have passed (yielding the core past
   AC_TEAM_HOT_NS). */
static void ac_team_spin_gen(const unsigned long *word, unsigned long seen, long ns)
{
    long t0 = ac_team_ns(), dt;
    int k;
    for (;;) {
        for (k = 0; k < 16; k++) {
            if (__atomic_load_n(word, __ATOMIC_ACQUIRE) != seen)
                return;
            ac_team_pause();
        }
        dt = ac_team_ns() - t0;
        if (dt > ns)
            return;
        if (dt > AC_TEAM_HOT_NS)
            sched_yield();   /* the core to whoever else can run */
    }
}

static void ac_team_claim(ac_team_job *job, int slot)
{
    ptrdiff_t i;
    int ran = 0;
    while ((i = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED)) < job->n) {
        job->item(job->ctx, i, slot);
        ran = 1;
    }
    if (ran && job->done)
        job->done(job->ctx, slot);
}

static void *ac_team_member(void *arg)
{
    ac_team_t *T = (ac_team_t *)arg;
    unsigned long seen = 0;   /* below every job's gen: the open job, if any, is joined */
    ac_team_job *job;
    int slot;
    for (;;) {
        ac_team_spin_gen(&T->gen, seen, AC_TEAM_SPIN_NS);
        pthread_mutex_lock(&T->mu);
        while (__atomic_load_n(&T->gen, __ATOMIC_ACQUIRE) == seen)
            pthread_cond_wait(&T->wake, &T->mu);
        seen = __atomic_load_n(&T->gen, __ATOMIC_ACQUIRE);
        job = T->job;
        if (job == NULL || job->joined >= job->want) {
            pthread_mutex_unlock(&T->mu);
            continue;   /* a job already done, or already staffed */
        }
        slot = ++job->joined;
        __atomic_add_fetch(&job->refs, 1, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&T->mu);
        ac_team_claim(job, slot);
        pthread_mutex_lock(&T->mu);
        if (__atomic_sub_fetch(&job->refs, 1, __ATOMIC_ACQ_REL) == 0)
            pthread_cond_signal(&T->idle);   /* the one caller of this team */
        pthread_mutex_unlock(&T->mu);
    }
    return NULL;
}

/* Start members of T until `want` run (under T->mu); the number running. */
static int ac_team_grow(ac_team_t *T, int want)
{
    pthread_attr_t attr;
    pthread_t t;
    if (want > AC_TEAM_MAX)
        want = AC_TEAM_MAX;
    if (T->started >= want)
        return want;
    if (pthread_attr_init(&attr) != 0)
        return T->started;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    while (T->started < want) {
        if (pthread_create(&t, &attr, ac_team_member, T) != 0)
            break;   /* no more threads: the members there are do the work */
        T->started++;
    }
    pthread_attr_destroy(&attr);
    return T->started < want ? T->started : want;
}

/* A free team, taken; NULL when every team is busy. */
static ac_team_t *ac_team_take(void)
{
    int i, zero;
    pthread_once(&ac_teams_once, ac_teams_init);
    for (i = 0; i < AC_TEAMS; i++) {
        zero = 0;
        if (__atomic_load_n(&ac_teams[i].busy, __ATOMIC_RELAXED) == 0 &&
            __atomic_compare_exchange_n(&ac_teams[i].busy, &zero, 1, 0, __ATOMIC_ACQUIRE,
                                        __ATOMIC_RELAXED))
            return &ac_teams[i];
    }
    return NULL;
}

/* Run job on T with its caller as slot 0; returns when every member that
   joined has left. */
static void ac_team_job_run(ac_team_t *T, ac_team_job *job)
{
    pthread_mutex_lock(&T->mu);
    T->job = job;
    __atomic_add_fetch(&T->gen, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&T->wake);
    pthread_mutex_unlock(&T->mu);
    ac_team_claim(job, 0);
    pthread_mutex_lock(&T->mu);
    T->job = NULL;   /* closed: no member joins any more */
    pthread_mutex_unlock(&T->mu);
    if (__atomic_load_n(&job->refs, __ATOMIC_ACQUIRE) != 0) {
        long t0 = ac_team_ns();
        while (__atomic_load_n(&job->refs, __ATOMIC_ACQUIRE) != 0 &&
               ac_team_ns() - t0 < AC_TEAM_JOIN_SPIN_NS)
            ac_team_pause();
        pthread_mutex_lock(&T->mu);
        while (__atomic_load_n(&job->refs, __ATOMIC_ACQUIRE) != 0)
            pthread_cond_wait(&T->idle, &T->mu);
        pthread_mutex_unlock(&T->mu);
    }
}
#endif

static void ac_team_serial(ptrdiff_t n, ac_team_item_fn item, ac_team_done_fn done, void *ctx)
{
    ptrdiff_t i;
    for (i = 0; i < n; i++)
        item(ctx, i, 0);
    if (n > 0 && done)
        done(ctx, 0);
}

/* Run items 0 .. n-1 on at most nthreads threads, the calling one among
   them; returns when all have run.  Slots passed to item / done are below
   nthreads. */
static void ac_team_run(int nthreads, ptrdiff_t n, ac_team_item_fn item, ac_team_done_fn done,
                        void *ctx)
{
#ifdef AC_TEAM_THREADS
    ac_team_job job;
    ac_team_t *T;
    int want = nthreads - 1;
    if (want > n - 1)
        want = (int)(n - 1);
    T = want >= 1 ? ac_team_take() : NULL;
    if (T != NULL) {
        pthread_mutex_lock(&T->mu);
        want = ac_team_grow(T, want);
        pthread_mutex_unlock(&T->mu);
        if (want >= 1) {
            job.item = item;
            job.done = done;
            job.ctx = ctx;
            job.n = n;
            job.next = 0;
            job.want = want;
            job.joined = 0;
            job.refs = 0;
            ac_team_job_run(T, &job);
            __atomic_store_n(&T->busy, 0, __ATOMIC_RELEASE);
            return;
        }
        __atomic_store_n(&T->busy, 0, __ATOMIC_RELEASE);
    }
#else
    (void)nthreads;
#endif
    ac_team_serial(n, item, done, ctx);
}

/* Members started so far, over all teams (0 without them): for tests. */
static int ac_team_started(void)
{
#ifdef AC_TEAM_THREADS
    int i, s = 0;
    pthread_once(&ac_teams_once, ac_teams_init);
    for (i = 0; i < AC_TEAMS; i++) {
        pthread_mutex_lock(&ac_teams[i].mu);
        s += ac_teams[i].started;
        pthread_mutex_unlock(&ac_teams[i].mu);
    }
    return s;
#else
    return 0;
#endif
}

#endif
