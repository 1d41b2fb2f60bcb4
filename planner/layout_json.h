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

#include <functional>
#include <memory>
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
