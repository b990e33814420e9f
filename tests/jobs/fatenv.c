/* A GPU job's stand-in that gives itself a huge environment, as any user
 * can: prctl(PR_SET_MM, PR_SET_MM_MAP) points the kernel's idea of its
 * environ (what /proc/PID/environ reads) at a buffer of its own.
 *
 *   fatenv MIB [first|last|none] [EID] [FILE]
 *
 * MIB mebibytes of `FILLER=xxx...` variables, with GENV_ENVIRONMENT_ID=EID
 * first, last or nowhere; with FILE, the environ is mapped from that file
 * instead (one on a FUSE mount that never answers makes every read of
 * /proc/PID/environ hang in the kernel). Then sleeps until killed, silent
 * (a test sees the environ's size in /proc). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <linux/prctl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

static unsigned long field(const char *stat, int n) {
    /* Fields after the last ')' are numbered from 3. */
    const char *p = strrchr(stat, ')') + 2;
    for (int i = 3; i < n; i++) p = strchr(p, ' ') + 1;
    return strtoul(p, NULL, 10);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: fatenv MIB [first|last|none] [EID] [FILE]\n");
        return 2;
    }
    size_t size = strtoul(argv[1], NULL, 10) << 20;
    const char *where = argc > 2 ? argv[2] : "none";
    const char *eid = argc > 3 ? argv[3] : "";
    char *env;
    if (argc > 4) {
        int fd = open(argv[4], O_RDONLY);
        if (fd < 0) { perror(argv[4]); return 1; }
        env = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    } else {
        env = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    }
    if (env == MAP_FAILED) { perror("mmap"); return 1; }
    if (argc <= 4) {
        char var[4200];
        snprintf(var, sizeof var, "GENV_ENVIRONMENT_ID=%s", eid);
        size_t at = 0, n = strlen(var) + 1;
        if (strcmp(where, "first") == 0) { memcpy(env, var, n); at = n; }
        size_t end = strcmp(where, "last") == 0 ? size - n : size;
        while (at + 64 < end) {
            at += (size_t)snprintf(env + at, 64, "FILLER=%0*d", 50, 0) + 1;
        }
        memset(env + at, 'x', end - at);
        if (end > at) env[end - 1] = 0;
        if (strcmp(where, "last") == 0) memcpy(env + end, var, n);
    }
    char stat[4096];
    int sfd = open("/proc/self/stat", O_RDONLY);
    ssize_t got = read(sfd, stat, sizeof stat - 1);
    if (got <= 0) { perror("stat"); return 1; }
    stat[got] = 0;
    struct prctl_mm_map map = {
        .start_code = field(stat, 26), .end_code = field(stat, 27),
        .start_data = field(stat, 45), .end_data = field(stat, 46),
        .start_brk = field(stat, 47), .brk = (unsigned long)sbrk(0),
        .start_stack = field(stat, 28),
        .arg_start = field(stat, 48), .arg_end = field(stat, 49),
        .env_start = (unsigned long)env, .env_end = (unsigned long)env + size,
        .auxv = NULL, .auxv_size = 0, .exe_fd = (unsigned)-1,
    };
    if (prctl(PR_SET_MM, PR_SET_MM_MAP, &map, sizeof map, 0) != 0) {
        perror("prctl(PR_SET_MM_MAP)");
        return 1;
    }
    for (;;) pause();
}
