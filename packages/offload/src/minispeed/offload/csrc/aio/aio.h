// Asynchronous file I/O on a thread pool: read or write a host buffer at a file offset, many
// requests in flight, each cut into blocks that the workers run with pread/pwrite.
//
// No torch or pybind11 headers here (see binding/offload_binding.cpp). The Python wrapper
// (minispeed.offload.aio) checks buffers, sizes and O_DIRECT alignment before it submits, keeps the
// tensor alive until the request is waited on, and turns an error code into an OSError that names
// the path.
//
// Note [the portable back end]
// A blocking pread/pwrite on a worker thread is one I/O in flight, so `threads` workers keep up to
// `threads` blocks in flight: the same queue depth a libaio/io_uring back end reaches with one
// thread and `threads` submissions. It needs nothing but POSIX, so it always builds; its cost over
// the kernel's native async interfaces is one context switch per block, small against blocks of
// hundreds of KiB. With O_DIRECT the data moves by DMA from the buffer to the device; without it
// the kernel copies it through the page cache.

#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace minispeed_offload {

// Error codes beyond errno (negative, so they never collide with one).
constexpr int kShortRead = -1;  // the file ended before the request did

// Note [the I/O busy clock]
// Seconds during which at least one request of any AioEngine in this process was in flight,
// from its submit (the file opened) to its completion (last block done, fsync and close
// included): the time the process kept the disk working for it, overlapping requests counted
// once. `bytes moved / io_busy_seconds()` is the rate the process got from the disk while it
// used it, whatever it computed meanwhile; a benchmark compares it with `dd`'s.
double io_busy_seconds();

struct IoResult {
  int64_t bytes = 0;  // bytes transferred (all of the request when err == 0)
  int err = 0;        // 0, an errno, or kShortRead
  std::string message;
};

class AioEngine {
 public:
  // `threads` workers; requests are cut into blocks of `block_bytes`. With `single_submit` a
  // request runs as one task on one worker, block after block (one block in flight per request).
  AioEngine(int threads, int64_t block_bytes, bool single_submit);
  ~AioEngine();
  AioEngine(const AioEngine&) = delete;
  AioEngine& operator=(const AioEngine&) = delete;

  // Queues a read or write of `nbytes` at `buffer` <-> `path`[offset, offset + nbytes).
  // Returns a request id for wait(). Errors (open failing included) are reported by wait().
  int64_t submit(const std::string& path, uintptr_t buffer, int64_t nbytes, int64_t offset,
                 bool write, bool direct, bool fsync_after);
  // Blocks until request `id` is complete, forgets it, and returns its result.
  IoResult wait(int64_t id);
  // Requests submitted and not yet waited on.
  int64_t pending();
  int threads() const { return static_cast<int>(workers_.size()); }

 private:
  struct Request {
    int fd = -1;
    char* buffer = nullptr;
    int64_t nbytes = 0;
    int64_t offset = 0;
    bool write = false;
    bool fsync_after = false;
    int64_t blocks_left = 0;
    int64_t bytes_done = 0;
    bool done = false;
    IoResult result;
  };
  struct Block {
    std::shared_ptr<Request> request;
    int64_t begin;  // offset inside the request
    int64_t length;
  };

  void worker_loop();
  void run_block(const Block& block);
  void finish_block(const std::shared_ptr<Request>& request, int64_t bytes, int err,
                    const std::string& message);

  int64_t block_bytes_;
  bool single_submit_;
  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable request_done_;
  std::deque<Block> queue_;
  std::unordered_map<int64_t, std::shared_ptr<Request>> requests_;
  int64_t next_id_ = 1;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace minispeed_offload
