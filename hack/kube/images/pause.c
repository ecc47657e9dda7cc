/*
 * pause: the pod sandbox process for hack/kube's real node.
 *
 * Written for Sandman's test harness (not derived from the upstream pause
 * program). It holds the pod's namespaces open by doing nothing: it sleeps
 * until SIGTERM or SIGINT and, being PID 1 of the pod when the PID namespace
 * is shared, reaps any child that gets re-parented to it.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile sig_atomic_t stopping;

static void on_stop(int sig) {
    (void)sig;
    stopping = 1;
}

static void on_child(int sig) {
    int saved = errno;
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
    errno = saved;
}

int main(void) {
    struct sigaction sa = {0};
    sigset_t blocked, waiting;

    /* Block the signals we wait for, so none can arrive between the check
     * of `stopping` and sigsuspend(). */
    sigemptyset(&blocked);
    sigaddset(&blocked, SIGTERM);
    sigaddset(&blocked, SIGINT);
    sigaddset(&blocked, SIGCHLD);
    sigprocmask(SIG_BLOCK, &blocked, &waiting);
    sigdelset(&waiting, SIGTERM);
    sigdelset(&waiting, SIGINT);
    sigdelset(&waiting, SIGCHLD);

    sa.sa_handler = on_stop;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sa.sa_handler = on_child;
    sa.sa_flags = SA_NOCLDSTOP | SA_RESTART;
    sigaction(SIGCHLD, &sa, NULL);

    if (getpid() != 1) {
        fputs("pause: warning: not running as PID 1\n", stderr);
    }
    while (!stopping) {
        sigsuspend(&waiting);
    }
    return 0;
}
