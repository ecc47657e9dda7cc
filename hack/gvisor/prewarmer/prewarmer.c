// gvisor-sentry-prewarmer, for runsc built by hack/gvisor/build.
//
// runsc (>= 2026) looks for this sidecar in gvisor-bin/ beside itself and, when it is
// there, starts the sandbox process as
//     gvisor-sentry-prewarmer <boot binary> runsc-sandbox <flags> boot <flags>
// It must grow the process's file descriptor table to 256 entries, then exec
// <boot binary> with argv[2:] as its argv. Why: the sentry moves its stdio to fds
// 253-255 (startingStdioFD in runsc/boot/loader.go). Linux grows an fd table by
// powers of two and, in a multi-threaded process (every Go program), waits a full RCU
// grace period to do it: 9-15 ms at each create on this host. Here, single-threaded,
// growing it costs nothing, and exec keeps the table's size. Upstream ships a C sidecar
// that does this, built by Bazel only: gVisor's Go branch has neither the source nor
// the binary, and runsc warns at every create that it is missing.
//
// No libc (raw system calls, x86-64 and arm64): the program is a few hundred bytes
// and runs in the create's hot path. It opens nothing it keeps; the fds runsc donates
// to the sentry (3 up, densely) are left as they are.

#include <asm/unistd.h>
#include <linux/fcntl.h>

// The highest fd the sentry uses for stdio: 253 + 2. Must fit the table without
// growing it again (256 entries).
#define HIGHEST_STDIO_FD 255

#if defined(__x86_64__)
static long call3(long nr, long a, long b, long c) {
  long ret;
  __asm__ volatile("syscall"
                   : "=a"(ret)
                   : "a"(nr), "D"(a), "S"(b), "d"(c)
                   : "rcx", "r11", "memory");
  return ret;
}
__asm__(".globl _start\n_start:\n  mov %rsp, %rdi\n  call run\n  ud2\n");
#elif defined(__aarch64__)
static long call3(long nr, long a, long b, long c) {
  register long x8 __asm__("x8") = nr;
  register long x0 __asm__("x0") = a;
  register long x1 __asm__("x1") = b;
  register long x2 __asm__("x2") = c;
  __asm__ volatile("svc #0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2) : "memory", "cc");
  return x0;
}
__asm__(".globl _start\n_start:\n  mov x0, sp\n  bl run\n  brk #0\n");
#else
#error "unsupported architecture"
#endif

static void say(const char* text) {
  long n = 0;
  while (text[n]) n++;
  call3(__NR_write, 2, (long)text, n);
}

// The initial stack: argc, argv[0..argc-1], NULL, envp..., NULL.
__attribute__((noreturn, used)) void run(long* stack) {
  long argc = stack[0];
  char** argv = (char**)(stack + 1);
  char** envp = argv + argc + 1;
  if (argc < 3) {
    say("gvisor-sentry-prewarmer: runsc runs this: <binary> <argv0> [args...]\n");
    call3(__NR_exit_group, 2, 0, 0);
  }
  // A descriptor of our own (fds 0-2 may be closed), copied to the lowest free fd
  // >= 255: that grows the table to 256 without touching any inherited fd. Both are
  // close-on-exec and closed here anyway; the table keeps its size. If this fails the
  // sentry only starts slower, as without this program.
  long base = call3(__NR_openat, AT_FDCWD, (long)"/", O_PATH | O_CLOEXEC);
  if (base >= 0) {
    long high = call3(__NR_fcntl, base, F_DUPFD_CLOEXEC, HIGHEST_STDIO_FD);
    if (high >= 0) call3(__NR_close, high, 0, 0);
    call3(__NR_close, base, 0, 0);
  }
  call3(__NR_execve, (long)argv[1], (long)(argv + 2), (long)envp);
  say("gvisor-sentry-prewarmer: cannot exec the sentry\n");
  call3(__NR_exit_group, 127, 0, 0);
  for (;;) {
  }
}
