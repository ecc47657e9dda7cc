/* Opens inotify instances until COUNT are open or the kernel refuses one, prints
 * "<opened> <errno of the refusal, 0 if none>", and with "hold" keeps them open until
 * killed: the attack on the host's per-user inotify limit (fs.inotify.max_user_instances)
 * that tests/providers/local/test_userns.py plays. Built static with the host's gcc. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <unistd.h>

int main(int argc, char **argv) {
    long count = argc > 1 ? atol(argv[1]) : 100000;
    int hold = argc > 2 && strcmp(argv[2], "hold") == 0;
    long opened = 0;
    int refused = 0;
    while (opened < count) {
        if (inotify_init1(IN_CLOEXEC) < 0) {
            refused = errno;
            break;
        }
        opened++;
    }
    printf("%ld %d\n", opened, refused);
    fflush(stdout);
    while (hold)
        pause();
    return 0;
}
