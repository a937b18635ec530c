// A file system with one file whose reads never answer until the test lets them: the storage
// service's "blocked file" (a hung network mount, a FUSE daemon that stopped) as a test double.
//
//   ferry_stuck_fs MOUNTPOINT RELEASE_FD
//
// /stuck is a 16 MiB regular file; opening it and asking for its attributes answer at once, but a
// read waits on RELEASE_FD (the read end of the test's pipe) until the test closes the write end,
// and then fails with EIO. The mount goes when the test unmounts it or kills this process.
#define FUSE_USE_VERSION 31
#include <fuse.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int release_fd = -1;

static int stuck_getattr(const char* path, struct stat* st, struct fuse_file_info* fi) {
  (void)fi;
  memset(st, 0, sizeof *st);
  if (strcmp(path, "/") == 0) {
    st->st_mode = S_IFDIR | 0755;
    st->st_nlink = 2;
    return 0;
  }
  if (strcmp(path, "/stuck") == 0) {
    st->st_mode = S_IFREG | 0644;
    st->st_nlink = 1;
    st->st_size = 16 << 20;
    return 0;
  }
  return -ENOENT;
}

static int stuck_read(const char* path, char* buf, size_t n, off_t off, struct fuse_file_info* fi) {
  (void)path, (void)buf, (void)n, (void)off, (void)fi;
  char c;
  while (read(release_fd, &c, 1) != 0) {  // nothing is ever written: this waits for the close
    if (errno != EINTR) break;
  }
  return -EIO;
}

static const struct fuse_operations ops = {.getattr = stuck_getattr, .read = stuck_read};

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s MOUNTPOINT RELEASE_FD\n", argv[0]);
    return 2;
  }
  release_fd = atoi(argv[2]);
  // Foreground and multi-threaded: a stuck read must not stop getattr. Reads go through the page
  // cache, so a server that maps the file waits in a page fault.
  char* args[] = {argv[0], "-f", argv[1], NULL};
  return fuse_main(3, args, &ops, NULL);
}
