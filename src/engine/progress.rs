//! Progress for long loads: a bar on a terminal once a load has taken more than a second, and a
//! log line every few seconds otherwise (containers have no terminal).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::time::{Duration, Instant};

pub struct LoadProgress {
    label: &'static str,
    total: u64,
    done: u64,
    started: Instant,
    last_log: Instant,
    bar: Option<ProgressBar>,
    tty: bool,
}

impl LoadProgress {
    pub fn new(label: &'static str, total: u64) -> Self {
        let now = Instant::now();
        LoadProgress {
            label,
            total,
            done: 0,
            started: now,
            last_log: now,
            bar: None,
            tty: std::io::stderr().is_terminal(),
        }
    }

    pub fn advance(&mut self, bytes: u64) {
        self.done = (self.done + bytes).min(self.total.max(self.done + bytes));
        let elapsed = self.started.elapsed();
        if elapsed < Duration::from_secs(1) {
            return;
        }
        if self.tty {
            let bar = self.bar.get_or_insert_with(|| {
                let b = ProgressBar::with_draw_target(Some(self.total), ProgressDrawTarget::stderr());
                b.set_style(
                    ProgressStyle::with_template(
                        "{msg} [{bar:40}] {binary_bytes}/{binary_total_bytes} ({eta})",
                    )
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
                );
                b.set_message(self.label);
                b
            });
            bar.set_position(self.done);
        } else if self.last_log.elapsed() >= Duration::from_secs(5) {
            self.last_log = Instant::now();
            tracing::info!(
                "{}: {:.1} of {:.1} GiB after {:.0} s",
                self.label,
                self.done as f64 / (1u64 << 30) as f64,
                self.total as f64 / (1u64 << 30) as f64,
                elapsed.as_secs_f64()
            );
        }
    }

    pub fn finish(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
    }
}
