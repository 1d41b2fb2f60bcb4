#pragma once
// A callable passed down a call and not kept: a pointer to it and to a
// function that calls it. Unlike std::function it never allocates (a
// lambda with more than two captures by reference takes a heap block in a
// std::function, once per call it is passed to: a hundred million times
// walking a DeepSeek-V3 plan's copies).
//
// It refers to the callable it was made from, which must outlive it: take
// it as a parameter, never store it.

#include <functional>
#include <memory>
#include <type_traits>
#include <utility>

namespace refit {

template <class Signature>
class FunctionRef;

template <class R, class... Args>
class FunctionRef<R(Args...)> {
 public:
  template <class F>
    requires(!std::is_same_v<std::remove_cvref_t<F>, FunctionRef> && std::is_invocable_r_v<R, F&, Args...>)
  FunctionRef(F&& f)  // NOLINT(google-explicit-constructor): passed like a std::function
      : obj_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_([](void* obj, Args... args) -> R {
          return std::invoke(*static_cast<std::remove_reference_t<F>*>(obj), std::forward<Args>(args)...);
        }) {}

  R operator()(Args... args) const { return call_(obj_, std::forward<Args>(args)...); }

 private:
  void* obj_;
  R (*call_)(void*, Args...);
};

}  // namespace refit
