/* Native frames on a segmentation fault, for a machine without gdb: LD_PRELOAD the shared object built from this
   file (gcc -shared -fPIC -o segv_frames.so segv_frames.c) and a crash prints each frame as `library(+offset)`,
   which `addr2line -f -C -e library offset` names (benchmarks/gpu_system.sh's dgprobe part does both). */
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void on_segv(int sig) {
  void *frames[64];
  int n = backtrace(frames, 64);
  static const char head[] = "native frames (segv_frames.c):\n";
  write(STDERR_FILENO, head, sizeof head - 1);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  void *warm[1];
  backtrace(warm, 1); /* load libgcc's unwinder now, not inside the handler */
  signal(SIGSEGV, on_segv);
}
