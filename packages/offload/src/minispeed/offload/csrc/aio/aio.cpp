// Thread-pool asynchronous I/O. See aio.h and Note [the portable back end].

#include "aio.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

namespace minispeed_offload {

namespace {

// Note [the I/O busy clock]: one clock for the process, every engine's requests on it.
struct BusyClock {
  std::mutex mutex;
  int64_t in_flight = 0;
  std::chrono::steady_clock::time_point since;
  double busy_s = 0;

  void begin() {
    std::lock_guard<std::mutex> lock(mutex);
    if (in_flight++ == 0) since = std::chrono::steady_clock::now();
  }
  void end() {
    std::lock_guard<std::mutex> lock(mutex);
    if (--in_flight == 0) {
      busy_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
    }
  }
  double seconds() {
    std::lock_guard<std::mutex> lock(mutex);
    const double open =
        in_flight > 0
            ? std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count()
            : 0.0;
    return busy_s + open;
  }
};

BusyClock& busy_clock() {
  static BusyClock clock;
  return clock;
}

}  // namespace

double io_busy_seconds() { return busy_clock().seconds(); }

AioEngine::AioEngine(int threads, int64_t block_bytes, bool single_submit)
    : block_bytes_(std::max<int64_t>(block_bytes, 4096)), single_submit_(single_submit) {
  threads = std::max(threads, 1);
  for (int t = 0; t < threads; ++t) workers_.emplace_back([this] { worker_loop(); });
}

AioEngine::~AioEngine() {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    // Finish every request first: a buffer handed to a request must never be touched after its
    // owner was told it is free (the Python wrapper also waits on each request it submitted).
    request_done_.wait(lock, [this] {
      return std::all_of(requests_.begin(), requests_.end(),
                         [](const auto& entry) { return entry.second->done; });
    });
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (auto& w : workers_) w.join();
}

int64_t AioEngine::submit(const std::string& path, uintptr_t buffer, int64_t nbytes,
                          int64_t offset, bool write, bool direct, bool fsync_after) {
  auto request = std::make_shared<Request>();
  request->buffer = reinterpret_cast<char*>(buffer);
  request->nbytes = nbytes;
  request->offset = offset;
  request->write = write;
  request->fsync_after = fsync_after;
  int flags = write ? (O_WRONLY | O_CREAT) : O_RDONLY;
  if (direct) flags |= O_DIRECT;
  request->fd = ::open(path.c_str(), flags | O_CLOEXEC, 0644);
  std::unique_lock<std::mutex> lock(mutex_);
  const int64_t id = next_id_++;
  requests_[id] = request;
  if (request->fd < 0) {
    request->result = {0, errno, std::string("open: ") + std::strerror(errno)};
    request->done = true;
    return id;
  }
  busy_clock().begin();  // ended in finish_block, once per request
  if (nbytes == 0) {
    lock.unlock();
    finish_block(request, 0, 0, "");
    return id;
  }
  const int64_t block = single_submit_ ? nbytes : block_bytes_;
  request->blocks_left = (nbytes + block - 1) / block;
  for (int64_t b = 0; b < nbytes; b += block) {
    queue_.push_back({request, b, std::min(block, nbytes - b)});
  }
  lock.unlock();
  work_ready_.notify_all();
  return id;
}

void AioEngine::worker_loop() {
  for (;;) {
    Block block;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      block = std::move(queue_.front());
      queue_.pop_front();
    }
    run_block(block);
  }
}

void AioEngine::run_block(const Block& block) {
  Request& r = *block.request;
  int64_t done = 0;
  int err = 0;
  std::string message;
  // A single-submit request is one block of the whole request, still cut into block_bytes_ calls.
  while (done < block.length) {
    const int64_t chunk = std::min(block_bytes_, block.length - done);
    char* buf = r.buffer + block.begin + done;
    const off_t at = static_cast<off_t>(r.offset + block.begin + done);
    const ssize_t n = r.write ? ::pwrite(r.fd, buf, static_cast<size_t>(chunk), at)
                              : ::pread(r.fd, buf, static_cast<size_t>(chunk), at);
    if (n < 0) {
      if (errno == EINTR) continue;
      err = errno;
      message = std::string(r.write ? "pwrite: " : "pread: ") + std::strerror(errno);
      break;
    }
    if (n == 0) {
      if (r.write) {
        err = ENOSPC;  // a write that makes no progress: the device took nothing
        message = "pwrite wrote 0 bytes";
      } else {
        struct stat st;
        const int64_t size = ::fstat(r.fd, &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
        err = kShortRead;
        message = "short read: the file has " + std::to_string(size) + " bytes, the request needs " +
                  std::to_string(r.offset + r.nbytes);
      }
      break;
    }
    done += n;
  }
  finish_block(block.request, done, err, message);
}

void AioEngine::finish_block(const std::shared_ptr<Request>& request, int64_t bytes, int err,
                             const std::string& message) {
  bool last;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    request->bytes_done += bytes;
    if (err != 0 && request->result.err == 0) request->result = {0, err, message};
    last = --request->blocks_left <= 0;
  }
  if (!last) return;
  if (request->fsync_after && request->result.err == 0 && ::fsync(request->fd) != 0) {
    std::lock_guard<std::mutex> lock(mutex_);
    request->result = {0, errno, std::string("fsync: ") + std::strerror(errno)};
  }
  ::close(request->fd);
  busy_clock().end();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    request->result.bytes = request->bytes_done;
    request->done = true;
  }
  request_done_.notify_all();
}

IoResult AioEngine::wait(int64_t id) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = requests_.find(id);
  if (it == requests_.end()) {
    return {0, EINVAL, "unknown request id " + std::to_string(id) + " (already waited on?)"};
  }
  std::shared_ptr<Request> request = it->second;
  request_done_.wait(lock, [&] { return request->done; });
  requests_.erase(id);
  return request->result;
}

int64_t AioEngine::pending() {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(requests_.size());
}

}  // namespace minispeed_offload
