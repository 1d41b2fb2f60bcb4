// ThreadFactory (transport/common/threads.h): a refused thread is a Status
// naming the thread, and an exception that leaves a thread's body is a log
// line and a call to the starter's handler, never std::terminate.
#include "transport/common/threads.h"

#include <gtest/gtest.h>
#include <pthread.h>

#include <atomic>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace refit {
namespace {

TEST(ThreadFactory, ARefusedThreadIsAStatusThatNamesIt) {
  ThreadFactory threads = ThreadFactory::refusing_after(1);
  std::atomic<int> ran{0};
  Result<std::thread> first = threads.start("first", [&] { ++ran; });
  ASSERT_TRUE(first.is_ok()) << first.status().message();
  first->join();
  Result<std::thread> second = threads.start("second", [&] { ++ran; });
  ASSERT_FALSE(second.is_ok());
  EXPECT_EQ(second.status().code(), Code::kIoError);
  EXPECT_EQ(second.status().reason(), Reason::kNoThread);
  EXPECT_NE(second.status().message().find("cannot start the second thread"), std::string::npos)
      << second.status().message();
  EXPECT_EQ(ran.load(), 1) << "a refused thread's body ran";
}

TEST(ThreadFactory, CopiesShareTheirBudget) {
  ThreadFactory threads = ThreadFactory::refusing_after(1);
  ThreadFactory copy = threads;
  Result<std::thread> a = copy.start("a", [] {});
  ASSERT_TRUE(a.is_ok());
  a->join();
  EXPECT_FALSE(threads.start("b", [] {}).is_ok()) << "a copy's thread did not count";
  Result<std::thread> c = ThreadFactory().start("c", [] {});  // no limit
  ASSERT_TRUE(c.is_ok());
  c->join();
}

// The system knows each thread by its role, cut to the 15 bytes Linux keeps.
TEST(ThreadFactory, AThreadCarriesItsNameToTheSystem) {
  ThreadFactory threads;
  for (const std::string what : {"heartbeat", "landing ring copy"}) {
    char name[16] = {};
    Result<std::thread> t = threads.start(what, [&] { pthread_getname_np(pthread_self(), name, sizeof(name)); });
    ASSERT_TRUE(t.is_ok());
    t->join();
    EXPECT_EQ(std::string(name), ThreadFactory::system_name(what));
  }
  EXPECT_EQ(ThreadFactory::system_name("heartbeat"), "refit heartbeat");
  EXPECT_EQ(ThreadFactory::system_name("landing ring copy"), "refit landing r");
}

// Without the catch-all, each of these bodies ends the process (std::terminate).
TEST(ThreadFactory, AnExceptionLeavingABodyIsLoggedAndHandedToTheStarter) {
  std::mutex mu;
  std::vector<std::string> lines;
  std::vector<Status> failures;
  ThreadFactory threads;
  threads.set_log([&](const std::string& line) {
    std::lock_guard<std::mutex> lock(mu);
    lines.push_back(line);
  });
  auto failed = [&](const Status& why) {
    std::lock_guard<std::mutex> lock(mu);
    failures.push_back(why);
  };
  Result<std::thread> a = threads.start("thrower", [] { throw std::runtime_error("disk on fire"); }, failed);
  ASSERT_TRUE(a.is_ok());
  a->join();
  Result<std::thread> b = threads.start("odd thrower", [] { throw 7; }, failed);
  ASSERT_TRUE(b.is_ok());
  b->join();
  // No handler, and a handler that throws too: logged, nothing else.
  Result<std::thread> c = threads.start("quiet thrower", [] { throw std::logic_error("bug"); });
  ASSERT_TRUE(c.is_ok());
  c->join();
  Result<std::thread> d = threads.start(
      "double thrower", [] { throw std::logic_error("first"); }, [](const Status&) { throw std::logic_error("again"); });
  ASSERT_TRUE(d.is_ok());
  d->join();

  ASSERT_EQ(failures.size(), 2u);
  EXPECT_EQ(failures[0].code(), Code::kInternal);
  EXPECT_EQ(failures[0].message(), "the thrower thread failed: disk on fire");
  EXPECT_EQ(failures[1].message(), "the odd thrower thread failed: an exception that is not a std::exception");
  ASSERT_EQ(lines.size(), 5u);
  EXPECT_EQ(lines[0], "the thrower thread failed: disk on fire");
  EXPECT_EQ(lines[2], "the quiet thrower thread failed: bug");
  EXPECT_EQ(lines[3], "the double thrower thread failed: first");
  EXPECT_EQ(lines[4], "the double thrower thread failed, and releasing its waiters failed too");
}

}  // namespace
}  // namespace refit
