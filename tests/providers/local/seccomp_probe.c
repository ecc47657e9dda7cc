/* Tries system calls from inside a sandbox; built static by test_seccomp.py.
 *
 * Each probe runs in a child process (so what one changes, e.g. a new user
 * namespace, does not leak into the next) and prints one line:
 * "<name> ok" or "<name> <errno name>" or "<name> signal <n>".
 * The "int80_*" probes make 32-bit system calls with `int $0x80` from this
 * 64-bit process: the kernel takes them as i386 calls, under their i386
 * numbers, which is how a filter written for x86_64 only would be bypassed.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/io_uring.h>
#include <linux/keyctl.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/personality.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef AF_VSOCK
#define AF_VSOCK 40
#endif

static char fstype[] = "tmpfs";
static char target[] = "/tmp";

static long int80(long nr, long a, long b, long c, long d, long e) {
    long ret;
    __asm__ volatile("int $0x80"
                     : "=a"(ret)
                     : "a"(nr), "b"(a), "c"(b), "d"(c), "S"(d), "D"(e)
                     : "memory");
    if (ret < 0 && ret > -4096) {
        errno = (int)-ret;
        return -1;
    }
    return ret;
}

static void *spin(void *arg) {
    volatile long n = 0;
    for (long i = 0; i < 1000000; i++) n += i;
    return arg;
}

static long threads(void) {
    pthread_t t[8];
    for (int i = 0; i < 8; i++)
        if (pthread_create(&t[i], NULL, spin, NULL) != 0) return -1;
    for (int i = 0; i < 8; i++) pthread_join(t[i], NULL);
    return 0;
}

static long probe(const char *name) {
    struct io_uring_params params;
    memset(&params, 0, sizeof(params));
    if (!strcmp(name, "unshare_user")) return syscall(SYS_unshare, CLONE_NEWUSER);
    if (!strcmp(name, "unshare_mount")) return syscall(SYS_unshare, CLONE_NEWNS);
    if (!strcmp(name, "clone_newuser")) {
        long pid = syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0);
        if (pid == 0) _exit(0);
        return pid < 0 ? -1 : 0;
    }
    if (!strcmp(name, "clone3")) return syscall(SYS_clone3, NULL, 0);
    if (!strcmp(name, "fork")) {
        pid_t pid = fork();
        if (pid == 0) _exit(0);
        return pid < 0 ? -1 : waitpid(pid, NULL, 0) < 0 ? -1 : 0;
    }
    if (!strcmp(name, "threads")) return threads();
    if (!strcmp(name, "setns")) return syscall(SYS_setns, 0, CLONE_NEWNET);
    if (!strcmp(name, "mount")) return mount("t", target, fstype, 0, NULL);
    if (!strcmp(name, "fsopen")) return syscall(SYS_fsopen, fstype, 0);
    if (!strcmp(name, "add_key"))
        return syscall(SYS_add_key, "user", "k", "v", 1, KEY_SPEC_PROCESS_KEYRING);
    if (!strcmp(name, "keyctl"))
        return syscall(SYS_keyctl, KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, 1);
    if (!strcmp(name, "io_uring_setup")) return syscall(SYS_io_uring_setup, 8, &params);
    if (!strcmp(name, "bpf")) return syscall(SYS_bpf, 0, NULL, 0);
    if (!strcmp(name, "perf_event_open")) return syscall(SYS_perf_event_open, NULL, 0, -1, -1, 0);
    if (!strcmp(name, "ptrace")) return ptrace(PTRACE_ATTACH, 1, 0, 0);
    if (!strcmp(name, "userfaultfd")) return syscall(SYS_userfaultfd, 0);
    if (!strcmp(name, "open_by_handle_at")) return syscall(SYS_open_by_handle_at, -1, NULL, 0);
    if (!strcmp(name, "socket_vsock")) return socket(AF_VSOCK, SOCK_STREAM, 0);
    if (!strcmp(name, "socket_unix")) return socket(AF_UNIX, SOCK_STREAM, 0);
    if (!strcmp(name, "personality_linux32")) return personality(PER_LINUX32);
    if (!strcmp(name, "personality_no_aslr")) return personality(ADDR_NO_RANDOMIZE);
    /* i386 numbers: getpid 20, mount 21, unshare 310, keyctl 288, io_uring_setup 425. */
    if (!strcmp(name, "int80_getpid")) return int80(20, 0, 0, 0, 0, 0) == getpid() ? 0 : -1;
    if (!strcmp(name, "int80_unshare_user")) return int80(310, CLONE_NEWUSER, 0, 0, 0, 0);
    if (!strcmp(name, "int80_mount"))
        return int80(21, (long)fstype, (long)target, (long)fstype, 0, 0);
    if (!strcmp(name, "int80_keyctl"))
        return int80(288, KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, 1, 0, 0);
    if (!strcmp(name, "int80_io_uring_setup")) return int80(425, 8, (long)&params, 0, 0, 0);
    /* x32: the x86_64 number with bit 30 set. */
    if (!strcmp(name, "x32_unshare_user")) return syscall(0x40000000 | SYS_unshare, CLONE_NEWUSER);
    fprintf(stderr, "unknown probe %s\n", name);
    exit(2);
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        pid_t pid = fork();
        if (pid < 0) return 1;
        if (pid == 0) {
            errno = 0;
            long ret = probe(argv[i]);
            _exit(ret == -1 ? (errno ? errno : 255) : 0);
        }
        int status;
        if (waitpid(pid, &status, 0) < 0) return 1;
        if (WIFSIGNALED(status))
            printf("%s signal %d\n", argv[i], WTERMSIG(status));
        else if (WEXITSTATUS(status) == 0)
            printf("%s ok\n", argv[i]);
        else
            printf("%s %s\n", argv[i], strerrorname_np(WEXITSTATUS(status)) ?: "?");
        fflush(stdout);
    }
    return 0;
}
