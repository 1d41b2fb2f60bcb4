#pragma once
// Layout files (`refit-layout/1`) in and out, and the plan's runs export
// (`refit-runs/1`); docs/formats.md gives both
// formats.
//
// A layout file lists every source and receiver rank, every tensor, and for
// each tensor either DTensor specs (expanded as add_dtensor does, one buffer
// named after the tensor per rank that holds a piece) or explicit buffers of
// segments, or both. Writing always uses the explicit form: every buffer of
// every rank with its segments, so the file says exactly what the planner saw.

#include <array>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "planner/layout.h"
#include "planner/plan.h"
#include "planner/status.h"

namespace refit {

// Parses and checks a refit-layout/1 document, then runs validate(). Every
// message starts with `origin` and names the key path (`tensors[3].source.
// placements[1]`), the tensor or the buffer, and the problem. Explicit buffers
// of one name, dtype, size and identical segments on several ranks of a side
// share one Buffer, so reading back a written layout gives the rank sets that
// were written. The top-level "buffers" are checked and dropped one at a
// time as the text is read, once "format", "sources", "receivers" and
// "tensors" have been: a document that lists them first (as
// write_layout_json does) is never held as a DOM but for those four keys
// (a DOM takes about seven times its text); buffers listed before them are
// held until they come.
Result<Layout> parse_layout_json(std::string_view text, const std::string& origin);

// parse_layout_json for a caller that makes the document piece by piece
// (the coordinator, from its members' registrations), so that the whole
// document is never held at once: head() with the document without its
// "buffers", buffer() with each explicit buffer object in turn, finish()
// with the document again (its keys after the buffers are checked there).
// A head that holds "buffers" is refused: they are handed to buffer().
// The same checks and messages as parse_layout_json, which reads its text
// this way; a buffer's path in a message counts the buffers handed over.
// Each call after one that failed is refused too.
class LayoutBuilder {
 public:
  explicit LayoutBuilder(std::string origin);
  ~LayoutBuilder();
  LayoutBuilder(const LayoutBuilder&) = delete;
  LayoutBuilder& operator=(const LayoutBuilder&) = delete;

  Status head(const nlohmann::json& doc);
  Status buffer(const nlohmann::json& buffer);
  Result<Layout> finish(const nlohmann::json& doc);

  // An explicit buffer as values, not a JSON object: what a buffer object
  // says, its keys by their names. buffer(BufferView) checks and reports
  // what buffer(json) does (a value in a message shown as JSON), less what
  // only JSON can get wrong (a key missing or unknown, a value of another
  // kind), without a DOM: a DOM costs tens of allocations a segment, and a
  // cluster's membership has millions of segments.
  struct SegmentView {
    std::string_view tensor;
    std::span<const int64_t> start, size, strides;
    int64_t offset = 0;
    std::string_view dtype;  // "": the buffer's
  };
  struct BufferView {
    Side side = Side::kSource;
    int64_t rank = 0;
    std::string_view name;
    std::string_view dtype;
    int64_t bytes = 0;
    std::span<const SegmentView> segments;
  };
  Status buffer(const BufferView& buffer);

  // The head as values: the ranks and the tensors (name, dtype, shape; no
  // DTensor specs) and the block size, in place of head(doc); the layout is
  // then made by finish() with no document. The same checks and messages.
  struct RankView {
    int32_t domain = 0;
    int32_t instance = 0;  // receivers
  };
  struct TensorView {
    std::string_view name;
    std::string_view dtype;
    std::span<const int64_t> shape;
  };
  struct HeadView {
    std::span<const RankView> sources, receivers;
    std::span<const TensorView> tensors;
    std::array<int64_t, 2> weight_block_size{128, 128};
  };
  Status head(const HeadView& head);
  Result<Layout> finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The explicit form of `layout`: sources, receivers, tensors (name, dtype,
// shape), and one explicit buffer per rank of every Buffer's rank set with the
// segments of every region that uses that buffer and includes that rank.
// parse_layout_json(write_layout_json(L)) plans as L does. Linear in the
// output size; no JSON DOM is built.
std::string write_layout_json(const Layout& layout);

// Every run of `plan` (for_each_run order) as refit-runs/1. Buffers are named
// by Layout::buffers[i].name. Linear in the number of runs; no JSON DOM.
std::string write_runs_json(const Plan& plan);

// Receives written text piece by piece; returns false to report that it
// could not take it (a full disk), after which it is called no more.
using TextSink = std::function<bool(std::string_view)>;

// The same text as the functions above, handed to `sink` in pieces of about
// 1 MiB instead of returned whole: a cluster-scale plan has hundreds of
// millions of runs, more than fits in memory as one string. Returns false
// when the sink refused a piece. The planner does no I/O; the sink does.
bool write_layout_json(const Layout& layout, const TextSink& sink);
bool write_runs_json(const Plan& plan, const TextSink& sink);

}  // namespace refit
