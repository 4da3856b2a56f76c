/* Minimal pod sandbox "pause" process for the real-node test tier.
 * Sleeps until SIGINT/SIGTERM, reaps zombies (it may be PID 1 of a shared PID namespace).
 * Built with: gcc -Os -static -o pause pause.c && strip pause */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_term(int sig) { (void)sig; _exit(0); }

static void on_chld(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(int argc, char **argv) {
    (void)argv;
    struct sigaction sa = {0};
    if (argc > 1) return 0; /* "-v" and friends: nothing to report */
    sa.sa_handler = on_term;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sa.sa_handler = on_chld;
    sa.sa_flags = SA_NOCLDSTOP;
    sigaction(SIGCHLD, &sa, NULL);
    for (;;) pause();
    return 1;
}
