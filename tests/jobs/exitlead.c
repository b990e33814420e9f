/* A GPU job's stand-in whose main thread exits while a worker thread goes
 * on, as a few lines of any program can: the process then shows state Z
 * (its leader a zombie), its own /proc/PID/environ answers for nobody, and
 * yet it runs, and kill(PID) still ends all of it. Silent: a test sees the
 * leader gone in /proc. */
#include <pthread.h>
#include <unistd.h>

static void *work(void *arg) {
    (void)arg;
    for (;;) pause();
    return NULL;
}

int main(void) {
    pthread_t t;
    if (pthread_create(&t, NULL, work, NULL) != 0) return 1;
    pthread_exit(NULL);
}
